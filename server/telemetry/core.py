"""``Telemetry``: the server's one telemetry object — engine observer, request records,
Prometheus metrics, OpenTelemetry tracing (when configured) and the canonical log line.

``tokenwire serve`` builds it, hands it to the engine client as the observer (step and
request statistics arrive on the event loop, from the core's per-step records) and to the gRPC
server; handlers call ``begin`` / ``describe`` / ``admit`` / ``end`` around each request.
With tracing off there is no tracer, no span and no step record: the event loop only
updates a few Prometheus counters per step and, per finished request, its record.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tokenwire.runtime.engine.protocol import EngineClient, EngineStatsSnapshot
from tokenwire.runtime.outputs import FinishReason
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import RequestStats, StepStats
from tokenwire.server.telemetry.engine_gauges import EngineGauges
from tokenwire.server.telemetry.logs import get_logger
from tokenwire.server.telemetry.metrics import EngineMetrics
from tokenwire.server.telemetry.record import RequestRecord, summarize
from tokenwire.server.telemetry.spans import SpanFactory, summary_attributes
from tokenwire.server.telemetry.tracing import (
    TracingSettings,
    build_tracer_provider,
)
from tokenwire.server.tenants.limits import LimitExceeded

_PROPAGATOR = TraceContextTextMapPropagator()  # stateless
# The metrics' tenant of a request whose record names none. Engine requests without a record
# (the startup warm-up) are no client's: no request metric, step metric or log line counts them.
DEFAULT_TENANT_LABEL = "default"


def cache_config_labels(info: Any) -> tuple[tuple[str, str], ...]:
    """vLLM's ``cache_config_info`` labels that tokenwire knows (values as strings)."""
    blocks = getattr(info, "num_kv_blocks", None)
    if blocks is None:  # an engine stand-in without the facts (unit tests)
        return ()
    return (
        ("block_size", str(info.block_size)),
        ("cache_dtype", str(info.kv_cache_dtype)),
        ("enable_prefix_caching", str(bool(info.enable_prefix_caching))),
        ("num_gpu_blocks", str(blocks)),
        ("num_cpu_blocks", "None"),
        ("prefix_caching_hash_algo", "sha256"),
    )


class Telemetry:
    def __init__(
        self,
        tracing: TracingSettings | None = None,
        provider: TracerProvider | None = None,
        metrics_compat: str = "both",
    ) -> None:
        self.settings = tracing or TracingSettings()
        self.metrics_compat = metrics_compat  # --metrics-compat: tokenwire, vllm or both
        if provider is None and self.settings.enabled:
            provider = build_tracer_provider(self.settings)
        self.provider = provider
        self.spans = (
            None if provider is None else SpanFactory(provider, self.settings.step_sample_ratio)
        )
        self.metrics: EngineMetrics | None = None
        self.model_name = ""
        self.wired = False  # True once the engine reports to this object
        self._records: dict[str, RequestRecord] = {}
        self.log = get_logger("tokenwire.request")

    # ------------------------------------------------------------------ setup
    def attach(self, engine: EngineClient) -> None:
        """Bind to a started engine: model name, and gauges read from the stats snapshot the
        engine publishes after every step (never from the scheduler itself)."""
        self.model_name = engine.info.served_model_name
        self.wired = getattr(engine, "observer", None) is self

        # 0: LoRA off (and engine stand-ins without the field, as in unit tests).
        max_loras = int(getattr(engine.info, "max_loras", 0))

        def gauges() -> EngineGauges:
            return engine_gauges(engine.stats_snapshot(), max_loras, cache_config)

        cache_config = cache_config_labels(engine.info)
        self.metrics = EngineMetrics(self.model_name, gauges, self.metrics_compat)

    def grpc_interceptors(self) -> list[Any]:
        """The OTel grpc.aio server interceptor (RPC spans, W3C context from metadata).
        Health checks get no span: probes would flood the traces, and the interceptor's
        stream wrapper cannot run health's Watch (a coroutine that writes its replies)."""
        if self.provider is None:
            return []
        from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

        not_health = filters.negate(filters.health_check())
        return [aio_server_interceptor(tracer_provider=self.provider, filter_=not_health)]

    def exposition(self) -> bytes:
        return b"" if self.metrics is None else self.metrics.exposition()

    def shutdown(self) -> None:
        """Flush and stop the span exporter."""
        if self.provider is not None:
            self.provider.shutdown()

    # ------------------------------------------------------------------ engine observer
    def on_step(self, stats: StepStats) -> None:
        if not any(self._lookup(rid) is not None for rid in stats.scheduled):
            return  # no client request in it: the startup warm-up
        if self.metrics is not None:
            self.metrics.on_step(stats)
        if self.spans is not None:
            self.spans.step_span(stats, self._lookup)

    def on_request_finished(self, stats: RequestStats) -> None:
        record = self._lookup(stats.request_id)
        if record is None:
            # Not a client request: the startup warm-up (no handler opened a record), or a
            # request whose record an engine fault completed already (counted then).
            return
        # A client request is counted once its call has ended too (``_finalize``): the
        # metrics then say what the client got, not only how the engine ended it.
        if record.add_stats(stats):
            self._finalize(record)

    def _lookup(self, engine_id: str) -> RequestRecord | None:
        record = self._records.get(engine_id)
        if record is None and "#" in engine_id:  # choice i of an n > 1 request
            record = self._records.get(engine_id.rpartition("#")[0])
        return record

    # ------------------------------------------------------------------ handlers (event loop)
    def begin(
        self, request_id: str, internal_id: str, kind: str, parent: Context | None = None
    ) -> RequestRecord:
        """Open a request's record (and its span, as a child of ``parent`` or the current
        context — the RPC span)."""
        record = RequestRecord(request_id, internal_id, kind)
        record.attributes["model"] = self.model_name
        if self.spans is not None:
            span = self.spans.tracer.start_span(
                "tokenwire.request",
                context=parent,
                attributes={
                    "tokenwire.request_id": request_id,
                    "tokenwire.request.kind": kind,
                    "gen_ai.request.model": self.model_name,
                },
            )
            ctx = span.get_span_context()
            record.span = span
            record.trace_id = trace.format_trace_id(ctx.trace_id)
            record.span_id = trace.format_span_id(ctx.span_id)
        if self.wired and internal_id not in self._records:  # a duplicate id fails anyway
            self._records[internal_id] = record
        return record

    def set_tenant(self, record: RequestRecord, tenant: str) -> None:
        """The request's tenant (a key-file name, "default" or "anonymous": a bounded set):
        ``tokenwire.tenant`` on the span, ``tenant`` on the log line and the metrics."""
        record.attributes["tenant"] = tenant
        if record.span is not None:
            record.span.set_attribute("tokenwire.tenant", tenant)

    def refused(self, exc: BaseException) -> None:
        """Count a request a tenant's limit refused (any other failure: nothing)."""
        if isinstance(exc, LimitExceeded) and self.metrics is not None:
            self.metrics.rate_limited(exc.tenant, exc.limit)

    def select_model(self, record: RequestRecord, model: str) -> None:
        """The model the request runs with once resolved: the served model, or the LoRA
        adapter it named (``gen_ai.request.model`` and the log line's ``model``)."""
        record.attributes["model"] = model
        if record.span is not None:
            record.span.set_attribute("gen_ai.request.model", model)

    def describe(
        self, record: RequestRecord, params: SamplingParams, chat: bool, prompt: str | None
    ) -> None:
        """GenAI request attributes once the request is parsed."""
        if record.span is None:
            return
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat" if chat else "text_completion",
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.choice.count": params.n,
        }
        if params.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = params.max_tokens
        if params.top_k:
            attrs["gen_ai.request.top_k"] = params.top_k
        if params.seed is not None:
            attrs["gen_ai.request.seed"] = params.seed
        if self.settings.include_content and prompt is not None:
            attrs["gen_ai.prompt"] = prompt
        record.span.set_attributes(attrs)

    def admit(self, record: RequestRecord, num_engine_requests: int) -> None:
        """The engine accepted the request: wait for that many engine records."""
        record.admitted(num_engine_requests if self.wired else 0)

    def record_completion(self, record: RequestRecord, texts: list[str]) -> None:
        if record.span is not None and self.settings.include_content:
            record.span.set_attribute("gen_ai.completion", texts)

    def end(self, record: RequestRecord, status: str) -> None:
        """The call ended with ``status`` (a gRPC status name). INTERNAL (an engine or server
        fault) completes the record at once: its engine records may never arrive."""
        if record.end_call(status, force=status == "INTERNAL"):
            self._finalize(record)

    def bind(self, record: RequestRecord) -> None:
        """Bind request_id / trace_id / span_id to every later log line of the current task
        (grpc.aio runs each RPC, and the session runs each turn, in a task of its own)."""
        structlog.contextvars.bind_contextvars(
            request_id=record.request_id, trace_id=record.trace_id, span_id=record.span_id
        )

    def parent_from(self, traceparent: str, tracestate: str) -> Context | None:
        """A per-turn W3C trace context (None: the current context, the RPC span)."""
        if not traceparent or self.spans is None:
            return None
        return _PROPAGATOR.extract({"traceparent": traceparent, "tracestate": tracestate})

    # ------------------------------------------------------------------ finalization
    def _finalize(self, record: RequestRecord) -> None:
        if self._records.get(record.internal_id) is record:
            del self._records[record.internal_id]
        if self.metrics is not None:
            tenant = record.attributes.get("tenant") or DEFAULT_TENANT_LABEL
            outcome = client_finish_reason(record.status)
            for stats in record.stats:
                self.metrics.on_request_finished(stats, tenant, outcome)
            # An engine fault completed the record before the engine reported every choice.
            for _ in range((record.expected or 0) - len(record.stats)):
                self.metrics.request_failed(tenant, outcome or FinishReason.ERROR.value)
        summary = summarize(record.stats) if record.stats else None
        if record.span is not None and self.spans is not None:
            if summary is not None:
                self.spans.request_children(record)
                record.span.set_attributes(summary_attributes(summary))
                record.span.set_attribute("tokenwire.dp_rank", record.stats[0].dp_rank)
            steps = sorted({s.step_id for refs in record.steps.values() for s in refs})
            record.span.set_attribute("tokenwire.step_ids", steps)
            record.span.set_attribute("rpc.grpc.status", record.status or "")
            if record.status != "OK":
                record.span.set_status(trace.StatusCode.ERROR, record.status)
            record.span.end()
        fields: dict[str, Any] = {
            "request_id": record.request_id,
            "trace_id": record.trace_id,
            "span_id": record.span_id,
            "model": record.attributes["model"],
            "tenant": record.attributes.get("tenant"),
            "kind": record.kind,
            "status": record.status,
        }
        if summary is None:
            fields["e2e_s"] = round(time.monotonic() - record.started, 6)
        else:
            fields.update(_summary_fields(summary))
        self.log.info("request_finished", **fields)


def client_finish_reason(status: str | None) -> str | None:
    """The ``finish_reason`` label of a request whose call ended with ``status``: None for
    OK (the engine's own reasons), "cancelled" for a call the client cancelled or let
    expire, "error" for any other failure (e.g. a response over the send limit)."""
    if status == "OK":
        return None
    if status in ("CANCELLED", "DEADLINE_EXCEEDED"):
        return FinishReason.CANCELLED.value
    return FinishReason.ERROR.value


def _summary_fields(summary: Any) -> dict[str, Any]:
    def ms(value: float | None) -> float | None:
        return None if value is None else round(value, 6)

    return {
        "finish_reason": ",".join(summary.finish_reasons),
        "prompt_tokens": summary.prompt_tokens,
        "completion_tokens": summary.completion_tokens,
        "cached_tokens": summary.cached_tokens,
        "preemptions": summary.preemptions,
        "queue_time_s": ms(summary.queue_time),
        "ttft_s": ms(summary.ttft),
        "tpot_s": ms(summary.tpot),
        "e2e_s": ms(summary.e2e),
        **(
            {}
            if summary.acceptance_rate is None
            else {"spec_acceptance_rate": round(summary.acceptance_rate, 4)}
        ),
    }


def engine_gauges(
    snap: EngineStatsSnapshot, max_loras: int, cache_config: tuple[tuple[str, str], ...]
) -> EngineGauges:
    """What ``/metrics`` reads at scrape time; with several engine cores each core's own
    (``ranks``: the per-rank series, ``engine="0"``, ``"1"``, ...) beside the sum."""
    return EngineGauges(
        snap.num_running,
        snap.num_waiting,
        snap.kv_cache_usage,
        max_loras,
        snap.running_lora_adapters,
        snap.waiting_lora_adapters,
        kv_num_blocks=snap.kv_blocks_total,
        kv_free_blocks=snap.kv_blocks_free,
        prefix_cache_queries=snap.prefix_cache_queries,
        prefix_cache_hits=snap.prefix_cache_hits,
        cache_config=cache_config,
        kv_offload=snap.kv_offload,
        ranks=tuple(engine_gauges(r, max_loras, cache_config) for r in snap.ranks),
    )
