"""One request's telemetry record, shared by its handler (event loop) and the engine thread.

The handler opens it (request span, request attributes) and closes it with the call status;
the engine thread adds the ``RequestStats`` of each of its engine requests (``n`` choices ->
``n`` records) and, when tracing, the steps that served it. Whichever side completes last
finalizes (spans, the canonical log line) — exactly once, under the record's lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span, SpanContext

from tokenwire.runtime.stats import RequestStats


@dataclass(slots=True)
class StepRef:
    """An engine step that computed tokens for this request."""

    step_id: int
    start_ns: int
    end_ns: int
    num_tokens: int
    span_context: SpanContext | None  # None when the step was not sampled


@dataclass(frozen=True, slots=True)
class RequestSummary:
    """The request's figures across its choices (seconds; None when not reached)."""

    finish_reasons: tuple[str, ...]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    preemptions: int
    queue_time: float | None
    ttft: float | None
    tpot: float | None
    e2e: float
    draft_tokens: int = 0  # speculative decoding: drafts verified, and accepted
    accepted_tokens: int = 0
    tier_loaded_tokens: int = 0  # KV tiers: prompt tokens loaded back, and the loads' time
    tier_load_time: float = 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


def summarize(stats: list[RequestStats]) -> RequestSummary:
    arrival = min(s.arrival_time for s in stats)
    finished = max(s.finished_time for s in stats)
    scheduled = [s.first_scheduled_time for s in stats if s.first_scheduled_time is not None]
    first = [s.first_token_time for s in stats if s.first_token_time is not None]
    most = max(s.num_output_tokens for s in stats)
    tpot = None
    if first and most > 1:
        tpot = (finished - min(first)) / (most - 1)
    return RequestSummary(
        finish_reasons=tuple(s.finish_reason.value for s in stats),
        prompt_tokens=stats[0].num_prompt_tokens,
        completion_tokens=sum(s.num_output_tokens for s in stats),
        cached_tokens=stats[0].num_cached_tokens,
        preemptions=sum(s.num_preemptions for s in stats),
        queue_time=min(scheduled) - arrival if scheduled else None,
        ttft=min(first) - arrival if first else None,
        tpot=tpot,
        e2e=finished - arrival,
        draft_tokens=sum(s.num_draft_tokens for s in stats),
        accepted_tokens=sum(s.num_accepted_tokens for s in stats),
        tier_loaded_tokens=max(s.num_tier_loaded_tokens for s in stats),
        tier_load_time=max(s.tier_load_time for s in stats),
    )


@dataclass(slots=True)
class RequestRecord:
    request_id: str  # as the client knows it
    internal_id: str  # the engine's id (choice ids are ``<internal_id>#<i>`` when n > 1)
    kind: str  # "generate", "generate_stream", "session_turn"
    started: float = field(default_factory=time.monotonic)
    span: Span | None = None
    trace_id: str | None = None
    span_id: str | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    expected: int | None = None  # engine requests to wait for; None until admitted
    stats: list[RequestStats] = field(default_factory=list)
    steps: dict[str, list[StepRef]] = field(default_factory=dict)  # engine id -> steps
    status: str | None = None  # gRPC status name, set when the handler ends
    finalized: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def admitted(self, num_engine_requests: int) -> None:
        self.expected = num_engine_requests

    def add_stats(self, stats: RequestStats) -> bool:
        """Engine thread: one engine request ended. True when the record is now complete."""
        with self.lock:
            self.stats.append(stats)
            return self._claim()

    def end_call(self, status: str, force: bool = False) -> bool:
        """Handler: the call ended with ``status``. True when the record is now complete.

        ``force``: complete now, without waiting for engine records that may never come
        (an engine fault can end a request before the engine ever saw all its choices).
        """
        with self.lock:
            self.status = status
            if force and not self.finalized:
                self.finalized = True
                return True
            return self._claim()

    def _claim(self) -> bool:
        if self.finalized or self.status is None:
            return False
        if len(self.stats) < (self.expected or 0):
            return False
        self.finalized = True
        return True
