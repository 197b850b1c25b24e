"""Step and request statistics records built by hand for telemetry unit tests."""

from __future__ import annotations

import time
from types import SimpleNamespace

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tokenwire.runtime.engine.protocol import EngineStatsSnapshot
from tokenwire.runtime.outputs import FinishReason
from tokenwire.runtime.stats import RequestStats, StepStats
from tokenwire.server.telemetry.core import Telemetry
from tokenwire.server.telemetry.tracing import TracingSettings


def make(
    ratio: float = 1.0, content: bool = False, tracing: bool = True
) -> tuple[Telemetry, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = None
    if tracing:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = TracingSettings(
        "http://unused:4317", step_sample_ratio=ratio, include_content=content
    )
    telemetry = Telemetry(settings if tracing else None, provider)
    engine = SimpleNamespace(
        info=SimpleNamespace(served_model_name="m"),
        stats_snapshot=EngineStatsSnapshot,
        observer=telemetry,
    )
    telemetry.attach(engine)  # type: ignore[arg-type]
    return telemetry, exporter


def step(step_id: int, scheduled: dict[str, int], t0: float) -> StepStats:
    prefill = sum(n for n in scheduled.values() if n > 1)
    return StepStats(
        step_id, "prefill" if prefill else "decode", len(scheduled), prefill,
        sum(1 for n in scheduled.values() if n == 1), 0, 4, 60, 64, dict(scheduled),
        frozenset(r for r, n in scheduled.items() if n > 1), 0.001, 0.001, 0.01, 0.001, 0.001,
        time.time_ns() + int((t0 - time.monotonic()) * 1e9), 0.014,
    )  # fmt: skip


def finished(rid: str, t0: float, out: int = 3) -> RequestStats:
    return RequestStats(rid, t0, t0 + 0.001, t0 + 0.02, t0 + 0.06, 10, out, 0, 0,
                        FinishReason.LENGTH)  # fmt: skip
