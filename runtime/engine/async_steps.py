"""Async scheduling (``--async-scheduling``): the core plans step k+1 while step k runs.

``AsyncStepper.step()`` schedules step k+1 with one placeholder per row that step k samples
(``core.placeholders``), submits it to the executor, and only then waits for step k and
reconciles it (``Scheduler.update(..., advanced=True)``). The executor runs steps in order,
and its runner appends each sampled token to the request's row, so step k+1's input ids
come from the worker's own step-k samples; the scheduler never needs them to plan. A request
that step k finishes (stop token, max_tokens, abort) is already in step k+1: its token there
is dropped by ``update`` (the request is gone) and its blocks were freed when it finished;
the worker drops its row on the next step. So one step is in flight between calls, and the
step's bookkeeping (update, the front's detokenization, the next schedule) overlaps the
forward.

Features that need care but no fallback:

* structured outputs: step k+1 is scheduled without its grammar bitmask
  (``schedule(late_grammar=True)``) and submitted with a future of it (``late_bitmask``);
  its forward runs while step k is reconciled (the matchers take step k's tokens, and a
  request the grammar or a stop token ends finishes), then the core builds the bitmask of
  step k+1's constrained rows that are still unfinished and resolves the future; the worker
  waits on it only to sample. The future is always resolved (with the error when
  reconciling fails), so the forward thread never waits forever;
* embedding requests pool instead of sampling: the placeholder of one whose prompt step k
  completes only keeps it out of step k+1 (``finishes_by_length``), and ``update`` finishes
  it with its vector (also when step k+1's planning preempted it);
* prompt logprobs come from the prompt's own tokens (never a sampled one), and the worker
  keeps its place in them across chunks and restarts;
* LoRA: the scheduler admits an adapter against the running requests, which still include
  those the step in flight finishes, so a step never needs more than ``--max-loras`` slots;
* KV tiers: a plan rides in its step and the worker runs steps in order (step k+1's saves
  and disk writes read blocks after step k's forward wrote them); a load is done only once a
  reconciled step acknowledges it, so its request is admitted a step later at most.

* Session holds (``hold_as``): a turn that finishes while the step after it runs is held
  with that step's blocks; the step only writes the KV of the turn's last token, in a block
  no hash covers yet (hashes cover known tokens only), so the next turn's prefix hit reads
  nothing the step changes, and the worker runs steps in order: a block the hold or a
  release frees is rewritten only by a later step. A turn preempted by the next step's
  planning and finished by the pending update holds nothing (its blocks were freed): the
  next turn recomputes, as after an eviction.

* tensor parallelism: the ``MultiprocExecutor`` sends step k+1 to the ranks before step k's
  result is collected (a step with a late bitmask once the core resolves it, the bitmask in
  the step), and the ranks run steps in order. Every rank samples the same tokens (same
  logits, same seeded generators) and appends them to its own rows, as one rank does.

* speculative decoding (n-gram and draft model): a draft needs the row's last tokens, and a
  verify step emits a variable number of tokens, which moves the row's position, KV slots
  and draft room, so a step planned before the verify step is reconciled would make other
  drafts (and so other seeded outputs) than synchronous steps. So under speculation a step
  in flight whose rows sample is reconciled before the next one is planned
  (``plans_on_tokens``); what still overlaps that next step's forward is everything after
  its submission: the caller's handling of the outputs (the front's detokenization and
  streaming, the core loop's I/O and input polling). A step in flight that samples no row
  (prefill chunks) has nothing the next plan needs: the next one is planned while it runs,
  as without speculation. And a step planned beside one that samples nothing builds its
  grammar bitmask at once (the matchers are up to date; drafts get their per-position rows).

What async steps do not cover falls back to synchronous steps (schedule, run, update, with
nothing in flight), never to different output. Only an engine-wide cause is left
(``sync_reason``): an executor that cannot take a step while one runs (none today: both
submit steps).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.core.scheduler import Scheduler
from tokenwire.runtime.engine.fault import StepFault
from tokenwire.runtime.executor.base import AsyncExecutor, Executor
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.outputs import EngineCoreOutput
from tokenwire.runtime.scheduler_output import SchedulerOutput
from tokenwire.runtime.structured.bitmask import GrammarBitmask
from tokenwire.runtime.structured.manager import StructuredOutputManager

logger = logging.getLogger("tokenwire.engine")
# (step, its model output, schedule s, update s, started_at_ns, duration s) -> the observer.
ReportStep = Callable[[SchedulerOutput, ModelOutput, float, float, int, float], None]


def carries_work(so: SchedulerOutput) -> bool:
    """Whether a scheduled step must reach the executor: it runs tokens, or the workers must
    release rows (finished, preempted), or it has KV-tier copies to make or loads to wait for."""
    return not (
        so.is_empty
        and not so.finished_req_ids
        and not so.preempted_req_ids
        and so.kv_transfers is None
    )


def sync_reason(config: EngineConfig, executor: Executor) -> str | None:
    """Why this engine runs synchronous steps even with ``--async-scheduling``; None: it can
    run async steps."""
    if not isinstance(executor, AsyncExecutor):
        return f"its executor ({type(executor).__name__}) runs one step at a time"
    return None


def make_stepper(
    config: EngineConfig,
    executor: Executor,
    scheduler: Scheduler,
    structured: StructuredOutputManager,
    report_step: ReportStep | None,
    fault: StepFault | None,
    grammar_wait_s: float,
) -> AsyncStepper | None:
    """The engine's stepper under ``--async-scheduling``; None: synchronous steps (the flag
    is off, or ``sync_reason`` names what the engine runs that async steps do not cover)."""
    if not config.scheduler.async_scheduling:
        return None
    reason = sync_reason(config, executor)
    if reason is not None:
        logger.info("async scheduling is off for %s: steps run synchronously", reason)
        return None
    assert isinstance(executor, AsyncExecutor)
    return AsyncStepper(scheduler, executor, structured, report_step, fault, grammar_wait_s)


@dataclass(frozen=True, slots=True)
class InFlight:
    """A submitted step whose model output is not reconciled yet."""

    so: SchedulerOutput
    future: Future[ModelOutput]
    schedule_time: float
    started_ns: int
    started: float  # perf_counter when its schedule began
    samples: bool  # some row samples a token in it (it got a placeholder)


class AsyncStepper:
    """Drives ``scheduler`` and ``executor`` with at most one step in flight between calls.
    Not thread-safe: the core's one thread calls it."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: AsyncExecutor,
        structured: StructuredOutputManager,
        report_step: ReportStep | None,
        fault: StepFault | None,
        grammar_wait_s: float,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.structured = structured
        self.report_step = report_step
        self.fault = fault
        self.grammar_wait_s = grammar_wait_s
        self._flight: InFlight | None = None

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and submit one step, then reconcile the one before it; outputs are that
        earlier step's. The last step, once no request is left unfinished, is reconciled at
        once. Under speculative decoding a step in flight whose rows sample is reconciled
        first (``plans_on_tokens``): the next one is planned from its tokens, as synchronous
        steps plan it, and runs while the caller handles the outputs."""
        outputs = self.collect() if self.plans_on_tokens() else []
        started_ns, t0 = time.time_ns(), time.perf_counter()
        # A step planned while one that samples runs gets its grammar bitmask once that one
        # is reconciled (its tokens advance the matchers; else they are up to date now).
        late_grammar = self._flight is not None and self._flight.samples
        so = self.scheduler.schedule(late_grammar=late_grammar)
        rows = self.scheduler.grammar_rows(so) if late_grammar else []
        schedule_time = time.perf_counter() - t0
        if not carries_work(so):
            if self._flight is None and self.structured.num_pending:
                self.structured.wait(self.grammar_wait_s)
            return outputs + self.collect()
        if self.fault is not None:
            self.fault.before_execute()
        sampling = self.scheduler.advance(so)
        late: Future[GrammarBitmask | None] | None = Future() if rows else None
        future = self.executor.submit_model(so, late)
        flight = InFlight(so, future, schedule_time, started_ns, t0, sampling > 0)
        if late is None:
            outputs += self.collect()
        else:
            outputs += self._collect_then_mask(late, rows)
        self._flight = flight
        if not self.scheduler.has_unfinished_requests():
            outputs.extend(self.collect())
        return outputs

    def plans_on_tokens(self) -> bool:
        """Whether the next step's plan needs the tokens of the step in flight: under
        speculative decoding, when that step samples. The proposer drafts from a row's last
        tokens (n-gram), and a verify step emits a variable number of tokens, which moves
        the row's position, KV slots and draft room; planning without them would change the
        drafts (and so seeded outputs) against synchronous steps."""
        flight = self._flight
        return flight is not None and flight.samples and self.scheduler.proposer is not None

    def collect(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight (if any) and reconcile it; its outputs."""
        flight, self._flight = self._flight, None
        if flight is None:
            return []
        mo = flight.future.result()
        t2 = time.perf_counter()
        outputs = self.scheduler.update(flight.so, mo, advanced=True)
        t3 = time.perf_counter()
        if self.report_step is not None and not flight.so.is_empty:
            update_time = t3 - t2
            duration = t3 - flight.started
            self.report_step(
                flight.so, mo, flight.schedule_time, update_time, flight.started_ns, duration
            )
        return outputs

    def _collect_then_mask(
        self, late: Future[GrammarBitmask | None], rows: list[str]
    ) -> list[EngineCoreOutput]:
        """Reconcile the step in flight (its tokens advance the matchers), then hand the step
        just submitted its grammar bitmask (its forward runs meanwhile). The bitmask is always
        resolved, so the forward thread never waits forever: on an error it raises there too."""
        try:
            outputs = self.collect()
            late.set_result(self.structured.late_bitmask(rows, self.scheduler.requests))
        except BaseException as error:
            late.set_exception(error)
            raise
        return outputs

    def discard(self) -> None:
        """Shutdown: wait for the step in flight, if any, and forget it (errors included:
        the engine is stopping)."""
        flight, self._flight = self._flight, None
        if flight is not None:
            with contextlib.suppress(Exception):  # stopping: its failure no longer matters
                flight.future.result()
