"""``Telemetry`` counts client requests only, as their calls ended (defects issue, items 13
and 15), fed with plain engine records (no model): the startup warm-up (an engine request no
handler opened a record for) leaves no request or step metric and no span; a call that failed
after the engine finished is counted as the client saw it; an engine fault that ends a
request before the engine reported it still counts it once, as an error."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families
from stats_records import finished, make, step

from tokenwire.server.telemetry.core import Telemetry


def counts(telemetry: Telemetry) -> dict[tuple[str, str, str], float]:
    """(sample, finish_reason, tenant) -> value of the non-zero tokenwire counts."""
    out = {}
    for family in text_string_to_metric_families(telemetry.exposition().decode()):
        for s in family.samples:
            if s.name.startswith("tokenwire:") and s.value and not s.name.endswith("_created"):
                key = (s.name, s.labels.get("finish_reason", ""), s.labels.get("tenant", ""))
                out[key] = out.get(key, 0.0) + s.value
    return out


def test_warmup_leaves_no_metric_and_no_span() -> None:
    telemetry, exporter = make()
    t0 = time.monotonic()
    for i, n in enumerate((3, 1)):
        telemetry.on_step(step(i, {"warmup": n}, t0 + 0.01 * i))
    telemetry.on_request_finished(finished("warmup", t0, out=2))
    assert counts(telemetry) == {}
    assert exporter.get_finished_spans() == ()


def test_failed_call_is_counted_as_the_client_saw_it() -> None:
    telemetry, _ = make()
    record = telemetry.begin("r1", "anon/r1", "generate")
    telemetry.set_tenant(record, "alpha")
    telemetry.admit(record, 1)
    telemetry.on_request_finished(finished("anon/r1", time.monotonic()))  # engine: length
    telemetry.end(record, "RESOURCE_EXHAUSTED")  # the response was too large to send
    success = {k: v for k, v in counts(telemetry).items() if "request_success" in k[0]}
    assert success == {("tokenwire:request_success_total", "error", "alpha"): 1.0}


def test_engine_fault_counts_each_unreported_choice_once() -> None:
    telemetry, _ = make()
    record = telemetry.begin("r2", "anon/r2", "generate")
    telemetry.set_tenant(record, "alpha")
    telemetry.admit(record, 2)
    telemetry.end(record, "INTERNAL")
    telemetry.on_request_finished(finished("anon/r2#0", time.monotonic()))  # late: ignored
    success = {k: v for k, v in counts(telemetry).items() if "request_success" in k[0]}
    assert success == {("tokenwire:request_success_total", "error", "alpha"): 2.0}
