"""Turns the engine's plain records into spans (only constructed when tracing is on).

Span tree of one request (all in the caller's trace)::

    <RPC span>  GenerationService/GenerateStream     (grpc.aio interceptor, W3C parent)
      tokenwire.request                              (GenAI attributes, usage, TTFT, steps)
        tokenwire.queue                              (arrival -> first scheduled)
        tokenwire.prefill   x chunks                 (one per step that computed prompt tokens)
        tokenwire.decode                             (first token -> finished)

Every engine step is a ``tokenwire.step`` span in the engine's own trace (a short
``tokenwire.engine`` root span, renewed every ``STEPS_PER_ENGINE_TRACE`` steps), linked to
the request span of every request it served; prefill spans link to their step span. Request,
queue, prefill, decode and step spans carry ``tokenwire.dp_rank``: the engine core that served
the request or ran the step (0 with one core).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Link, SpanContext, Tracer

from tokenwire.runtime.stats import RequestStats, StepStats
from tokenwire.server.telemetry.record import RequestRecord, RequestSummary, StepRef

STEPS_PER_ENGINE_TRACE = 1000
INSTRUMENTATION = "tokenwire.server"


class SpanFactory:
    """Creates step spans (engine thread) and request child spans (at finalization)."""

    def __init__(self, provider: TracerProvider, step_sample_ratio: float = 1.0) -> None:
        self.provider = provider
        self.tracer: Tracer = provider.get_tracer(INSTRUMENTATION)
        self.step_sample_ratio = step_sample_ratio
        self._random = random.Random()
        self._engine_parent: Context | None = None
        self._engine_steps = 0
        # monotonic seconds -> wall-clock ns, for the runtime's ``time.monotonic`` instants.
        self._wall_offset_ns = time.time_ns() - int(time.monotonic() * 1e9)

    def wall_ns(self, monotonic: float) -> int:
        return int(monotonic * 1e9) + self._wall_offset_ns

    # ------------------------------------------------------------------ engine steps
    def _engine_context(self, step_id: int) -> Context:
        if self._engine_parent is None or self._engine_steps >= STEPS_PER_ENGINE_TRACE:
            root = self.tracer.start_span(
                "tokenwire.engine",
                context=trace.set_span_in_context(trace.INVALID_SPAN),
                attributes={"tokenwire.step.first_id": step_id},
            )
            root.end()
            self._engine_parent = trace.set_span_in_context(root)
            self._engine_steps = 0
        self._engine_steps += 1
        return self._engine_parent

    def step_span(
        self, stats: StepStats, lookup: Callable[[str], RequestRecord | None]
    ) -> SpanContext | None:
        """Emit the step's span (if sampled), linked to the request spans it served."""
        sampled = self.step_sample_ratio >= 1.0 or self._random.random() < self.step_sample_ratio
        span_context = None
        records = [(rid, n, lookup(rid)) for rid, n in stats.scheduled.items()]
        if sampled:
            links = [
                Link(r.span.get_span_context(), {"tokenwire.request_id": r.request_id})
                for _, _, r in records
                if r is not None and r.span is not None
            ]
            span = self.tracer.start_span(
                "tokenwire.step",
                context=self._engine_context(stats.step_id),
                links=links,
                start_time=stats.started_at_ns,
                attributes=step_attributes(stats),
            )
            span.end(end_time=stats.started_at_ns + int(stats.duration * 1e9))
            span_context = span.get_span_context()
        end_ns = stats.started_at_ns + int(stats.duration * 1e9)
        for rid, n, record in records:
            if record is not None:
                ref = StepRef(stats.step_id, stats.started_at_ns, end_ns, n, span_context)
                record.steps.setdefault(rid, []).append(ref)
        return span_context

    # ------------------------------------------------------------------ request children
    def request_children(self, record: RequestRecord) -> None:
        """Queue / prefill chunk / decode spans under the record's request span."""
        assert record.span is not None
        parent = trace.set_span_in_context(record.span)
        for stats in record.stats:
            steps = record.steps.get(stats.request_id, [])
            self._children(parent, stats, steps)

    def _children(self, parent: Context, stats: RequestStats, steps: list[StepRef]) -> None:
        tracer, ctx = self.tracer, parent
        choice: dict[str, str | int] = {
            "tokenwire.engine_request_id": stats.request_id,
            "tokenwire.dp_rank": stats.dp_rank,  # the engine core that served it
        }
        if stats.first_scheduled_time is not None:
            queue = tracer.start_span(
                "tokenwire.queue",
                context=ctx,
                start_time=self.wall_ns(stats.arrival_time),
                attributes=choice,
            )
            queue.end(end_time=self.wall_ns(stats.first_scheduled_time))
        first_token_ns = (
            self.wall_ns(stats.first_token_time) if stats.first_token_time is not None else None
        )
        decode_steps = 0
        for step in steps:
            if first_token_ns is not None and step.start_ns >= first_token_ns:
                decode_steps += 1
                continue
            links = [Link(step.span_context)] if step.span_context is not None else []
            chunk = tracer.start_span(
                "tokenwire.prefill",
                context=ctx,
                links=links,
                start_time=step.start_ns,
                attributes={
                    **choice,
                    "tokenwire.step.id": step.step_id,
                    "tokenwire.prefill.tokens": step.num_tokens,
                },
            )
            chunk.end(end_time=step.end_ns)
        if first_token_ns is not None and stats.num_output_tokens > 1:
            decode = tracer.start_span(
                "tokenwire.decode",
                context=ctx,
                start_time=first_token_ns,
                attributes={
                    **choice,
                    "tokenwire.decode.steps": decode_steps,
                    "tokenwire.decode.tokens": stats.num_output_tokens - 1,
                },
            )
            decode.end(end_time=self.wall_ns(stats.finished_time))


def step_attributes(stats: StepStats) -> dict[str, int | float | str]:
    return {
        "tokenwire.step.id": stats.step_id,
        "tokenwire.dp_rank": stats.dp_rank,  # the engine core (--data-parallel-size)
        "tokenwire.step.phase": stats.phase,
        "tokenwire.step.num_seqs": stats.num_seqs,
        "tokenwire.step.prefill_tokens": stats.num_prefill_tokens,
        "tokenwire.step.decode_tokens": stats.num_decode_tokens,
        "tokenwire.step.preemptions": stats.num_preemptions,
        "tokenwire.kv.blocks_used": stats.kv_blocks_used,
        "tokenwire.kv.blocks_free": stats.kv_blocks_free,
        "tokenwire.step.schedule_ms": stats.schedule_time * 1e3,
        "tokenwire.step.prepare_ms": stats.prepare_time * 1e3,
        "tokenwire.step.forward_ms": stats.forward_time * 1e3,
        "tokenwire.step.sample_ms": stats.sample_time * 1e3,
        "tokenwire.step.update_ms": stats.update_time * 1e3,
        # Tensor parallelism: rank 0's wall time in all-reduce / all-gather (within forward
        # and sample; 0 on one device).
        "tokenwire.step.collective_ms": stats.collective_time * 1e3,
        # Speculative decoding: draft tokens verified in this step, and accepted.
        "tokenwire.spec.draft_tokens": stats.num_draft_tokens,
        "tokenwire.spec.accepted_tokens": stats.num_accepted_tokens,
        # Image inputs: images the vision encoder ran on (within prepare), and cache hits.
        "tokenwire.step.images_encoded": stats.num_images_encoded,
        "tokenwire.step.encoder_cache_hits": stats.num_encoder_cache_hits,
        "tokenwire.step.encoder_ms": stats.encoder_time * 1e3,
    }


def summary_attributes(summary: RequestSummary) -> dict[str, int | float | tuple[str, ...]]:
    """GenAI semantic-convention usage / response attributes, plus tokenwire's timings."""
    attrs: dict[str, int | float | tuple[str, ...]] = {
        "gen_ai.usage.input_tokens": summary.prompt_tokens,
        "gen_ai.usage.output_tokens": summary.completion_tokens,
        "gen_ai.response.finish_reasons": summary.finish_reasons,
        "tokenwire.usage.cached_tokens": summary.cached_tokens,
        "tokenwire.preemptions": summary.preemptions,
        "tokenwire.e2e_s": summary.e2e,
    }
    for key, value in (
        ("tokenwire.queue_time_s", summary.queue_time),
        ("gen_ai.server.time_to_first_token", summary.ttft),
        ("gen_ai.server.time_per_output_token", summary.tpot),
        ("tokenwire.spec.acceptance_rate", summary.acceptance_rate),
        ("tokenwire.kv_tier.loaded_tokens", summary.tier_loaded_tokens or None),
        ("tokenwire.kv_tier.load_time_s", summary.tier_load_time or None),
    ):
        if value is not None:
            attrs[key] = value
    return attrs
