"""``StructuredOutputManager``: the scheduler's side of constrained decoding (no torch).

Each constrained request gets a ``RequestGrammar``: first the future of its compiled grammar
(compiling on the ``GrammarCompilerPool``), then an xgrammar matcher. The scheduler keeps a
request in the waiting queue until ``poll`` gives it a matcher (or fails it: compile error or
time-out), asks for the bitmask of the constrained rows that sample in a step
(``bitmask``), and advances each matcher with the accepted token in ``update``.

EOS: the matcher's stop tokens are the request's EOS ids (unless ``ignore_eos``) and its
``stop_token_ids``; the grammar allows them only where it is complete, so a constrained
request never ends early. With no stop token at all, the matcher terminates as soon as the
grammar is complete. Preemption needs no rollback: recompute keeps the output tokens, so the
matcher's state still matches them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenwire.runtime.core.spec.grammar_drafts import fill_draft_rows
from tokenwire.runtime.front.structured_validate import compiler_message
from tokenwire.runtime.outputs import EngineCoreOutput, FinishReason
from tokenwire.runtime.structured.bitmask import GrammarBitmask, num_words
from tokenwire.runtime.structured.compiler import GrammarCompilerPool
from tokenwire.runtime.structured.request_grammar import RequestGrammar

if TYPE_CHECKING:
    from tokenwire.runtime.core.request import Request


def failure_output(request: Request, message: str) -> EngineCoreOutput:
    """What reports a request whose constraint failed to compile: ERROR, the compiler's
    message as ``stop_reason`` and the field as ``error_param``."""
    constraint = request.sampling_params.structured_outputs
    assert constraint is not None
    return EngineCoreOutput(
        request.request_id,
        [],
        finish_reason=FinishReason.ERROR,
        stop_reason=message,
        error_param=f"structured_outputs.{constraint.kind}",
    )


class StructuredOutputManager:
    def __init__(
        self,
        pool: GrammarCompilerPool,
        vocab_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.words = num_words(vocab_size)
        self.clock = clock
        self._pending: list[Request] = []

    @property
    def num_pending(self) -> int:
        """Requests whose grammar is still compiling."""
        return len(self._pending)

    def register(self, request: Request) -> None:
        """Start compiling the request's constraint (a cache hit is ready at once)."""
        constraint = request.sampling_params.structured_outputs
        assert constraint is not None
        future = self.pool.submit(constraint.spec())
        deadline = self.clock() + self.pool.config.compile_timeout
        request.grammar = RequestGrammar(future, deadline)
        self._pending.append(request)

    def poll(self) -> list[tuple[Request, str]]:
        """Give a matcher to every pending request whose grammar compiled; returns the
        requests that failed (compile error or time-out) with the reason."""
        failed: list[tuple[Request, str]] = []
        pending: list[Request] = []
        now = self.clock()
        for request in self._pending:
            grammar = request.grammar
            if request.is_finished or grammar is None:
                continue  # aborted while compiling
            if grammar.future.done():
                error = grammar.future.exception()
                if error is None:
                    grammar.matcher = self._matcher(request, grammar.future.result())
                else:
                    failed.append((request, compiler_message(error)))
            elif now >= grammar.deadline:
                failed.append(
                    (
                        request,
                        f"compiling the constraint took longer than "
                        f"{self.pool.config.compile_timeout:g} s (the server's limit); "
                        "simplify it",
                    )
                )
            else:
                pending.append(request)
        self._pending = pending
        return failed

    def wait(self, timeout: float) -> None:
        """Block until a pending compile finishes or ``timeout`` s pass (an engine with
        nothing else to do waits here instead of spinning)."""
        futures = [r.grammar.future for r in self._pending if r.grammar is not None]
        if futures:
            wait_futures(futures, timeout, FIRST_COMPLETED)

    def bitmask_for(
        self,
        num_scheduled: Mapping[str, int],
        requests: Mapping[str, Request],
        drafts: Mapping[str, list[int]] | None = None,
    ) -> GrammarBitmask | None:
        """The bitmask of the constrained requests a step brings up to date (they sample);
        a request with ``drafts`` gets one row per scored position (``grammar_drafts``).
        None when there are none."""
        rows = [requests[request_id] for request_id in self.sampling_rows(num_scheduled, requests)]
        return self.bitmask(rows, drafts or {}) if rows else None

    @staticmethod
    def sampling_rows(
        num_scheduled: Mapping[str, int], requests: Mapping[str, Request]
    ) -> list[str]:
        """The constrained requests a step (just scheduled, not advanced) brings up to date:
        they sample, so their row needs a mask. Async scheduling: a token in flight
        (placeholder) counts as known."""
        rows = []
        for request_id, num_new in num_scheduled.items():
            request = requests[request_id]
            if request.grammar is not None and request.num_computed_tokens + num_new >= (
                request.num_tokens + request.num_output_placeholders
            ):
                rows.append(request_id)
        return rows

    def late_bitmask(
        self, req_ids: list[str], requests: Mapping[str, Request]
    ) -> GrammarBitmask | None:
        """Async scheduling: the mask of a step's constrained rows (``sampling_rows``), built
        once the step before it is reconciled (every matcher took its token). A request that
        finished meanwhile (stop token, completed grammar, abort) gets no row: its token in
        this step is dropped by ``update``."""
        rows = []
        for request_id in req_ids:
            request = requests.get(request_id)
            if request is not None and not request.is_finished:
                rows.append(request)
        return self.bitmask(rows) if rows else None

    def bitmask(
        self, requests: list[Request], drafts: Mapping[str, list[int]] | None = None
    ) -> GrammarBitmask:
        """Allowed next tokens of each request (all ready, none terminated): one row, or
        ``1 + len(draft)`` consecutive rows for a request with drafts."""
        drafts = drafts or {}
        counts = [1 + len(drafts.get(r.request_id, ())) for r in requests]
        array = np.empty((sum(counts), self.words), dtype=np.int32)
        req_ids: list[str] = []
        for request, count in zip(requests, counts, strict=True):
            assert request.grammar is not None
            draft = drafts.get(request.request_id, [])
            fill_draft_rows(request.grammar.matcher, draft, array, len(req_ids))
            req_ids.extend([request.request_id] * count)
        return GrammarBitmask.from_array(req_ids, array)

    def shutdown(self) -> None:
        self.pool.shutdown()

    @staticmethod
    def _matcher(request: Request, compiled: Any) -> Any:
        import xgrammar as xgr

        stops = sorted(request.eos_token_ids | request.stop_token_ids)
        if not stops:
            return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
