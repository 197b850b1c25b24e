"""``Telemetry`` fed with plain engine records (no model): request records finalize exactly
once whichever side ends last, step spans link to request spans, sampling and content flags
hold, and metrics count what the records say."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families
from stats_records import finished, make, step

from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.server.telemetry.core import Telemetry


def run_request(telemetry: Telemetry, rid: str, handler_first: bool) -> None:
    record = telemetry.begin(rid, f"anon/{rid}", "generate")
    telemetry.describe(record, SamplingParams(max_tokens=3, temperature=0.0), False, "secret")
    telemetry.admit(record, 1)
    t0 = time.monotonic()
    for i, n in enumerate((10, 1, 1)):
        telemetry.on_step(step(i, {f"anon/{rid}": n}, t0 + 0.02 * i))
    if handler_first:  # e.g. a cancelled call: the engine reports afterwards
        telemetry.end(record, "CANCELLED")
        assert not record.finalized
        telemetry.on_request_finished(finished(f"anon/{rid}", t0))
    else:
        telemetry.on_request_finished(finished(f"anon/{rid}", t0))
        assert not record.finalized
        telemetry.end(record, "OK")
    assert record.finalized


def test_request_tree_either_order() -> None:
    for handler_first in (False, True):
        telemetry, exporter = make()
        run_request(telemetry, "r1", handler_first)
        spans = exporter.get_finished_spans()
        (req,) = [s for s in spans if s.name == "tokenwire.request"]
        steps = [s for s in spans if s.name == "tokenwire.step"]
        assert len(steps) == 3
        assert all(s.links[0].context.span_id == req.context.span_id for s in steps)
        children = sorted(
            s.name for s in spans if s.parent and s.parent.span_id == req.context.span_id
        )
        assert children == ["tokenwire.decode", "tokenwire.prefill", "tokenwire.queue"]
        assert req.attributes["tokenwire.step_ids"] == (0, 1, 2)
        assert "gen_ai.prompt" not in req.attributes  # content is off by default
        assert not telemetry._records  # nothing left behind


def test_step_sampling_zero_and_content_flag() -> None:
    telemetry, exporter = make(ratio=0.0, content=True)
    run_request(telemetry, "r2", handler_first=False)
    spans = exporter.get_finished_spans()
    assert not [s for s in spans if s.name == "tokenwire.step"]
    (req,) = [s for s in spans if s.name == "tokenwire.request"]
    assert req.attributes["gen_ai.prompt"] == "secret"
    assert req.attributes["tokenwire.step_ids"] == (0, 1, 2)  # still recorded


def test_tracing_off_has_no_spans_and_metrics_count() -> None:
    telemetry, _ = make(tracing=False)
    assert telemetry.spans is None and telemetry.grpc_interceptors() == []
    run_request(telemetry, "r3", handler_first=False)
    families = {f.name: f for f in text_string_to_metric_families(telemetry.exposition().decode())}
    value = {s.name: s.value for f in families.values() for s in f.samples}
    assert value["tokenwire:prompt_tokens_total"] == 10
    assert value["tokenwire:generation_tokens_total"] == 3
    assert value["tokenwire:inter_token_latency_seconds_count"] == 2
    assert value["tokenwire:iteration_tokens_total_count"] == 3
    assert value["tokenwire:num_requests_running"] == 0


def test_engine_fault_completes_the_record_without_engine_stats() -> None:
    """An engine fault while adding an n=2 request: no engine record ever arrives, yet the
    request span ends with ERROR and nothing stays behind."""
    telemetry, exporter = make()
    record = telemetry.begin("r3", "anon/r3", "generate")
    telemetry.admit(record, 2)
    telemetry.end(record, "INTERNAL")
    assert record.finalized and not telemetry._records
    (req,) = [s for s in exporter.get_finished_spans() if s.name == "tokenwire.request"]
    assert not req.status.is_ok
    telemetry.on_request_finished(finished("anon/r3#0", time.monotonic()))  # late: ignored


def test_speculative_decoding_metrics_and_attributes() -> None:
    """vLLM's spec-decode counters (per position too), step span attributes and the request's
    acceptance rate on its span."""
    from dataclasses import replace

    telemetry, exporter = make()
    record = telemetry.begin("r4", "anon/r4", "generate")
    telemetry.admit(record, 1)
    t0 = time.monotonic()
    telemetry.on_step(step(0, {"anon/r4": 10}, t0))
    spec = replace(
        step(1, {"anon/r4": 4}, t0 + 0.02),
        num_drafts=1, num_draft_tokens=3, num_accepted_tokens=2,
        drafted_per_pos=(1, 1, 1), accepted_per_pos=(1, 1, 0),
    )  # fmt: skip
    telemetry.on_step(spec)
    done = replace(finished("anon/r4", t0, out=4), num_draft_tokens=3, num_accepted_tokens=2)
    telemetry.on_request_finished(done)
    telemetry.end(record, "OK")
    text = telemetry.exposition().decode()
    value = {
        (s.name, s.labels.get("position")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert value[("tokenwire:spec_decode_num_drafts_total", None)] == 1
    assert value[("tokenwire:spec_decode_num_draft_tokens_total", None)] == 3
    assert value[("tokenwire:spec_decode_num_accepted_tokens_total", None)] == 2
    per_pos = "tokenwire:spec_decode_num_accepted_tokens_per_pos_total"
    assert [value[(per_pos, str(i))] for i in range(3)] == [1, 1, 0]
    spans = exporter.get_finished_spans()
    (req,) = [s for s in spans if s.name == "tokenwire.request"]
    assert req.attributes is not None
    assert abs(float(req.attributes["tokenwire.spec.acceptance_rate"]) - 2 / 3) < 1e-9
    steps = [s for s in spans if s.attributes and s.attributes.get("tokenwire.step.id") == 1]
    assert steps and steps[0].attributes["tokenwire.spec.accepted_tokens"] == 2


def test_encoder_metrics_and_attributes() -> None:
    """Image inputs: images encoded, encoder-cache hits and encoder seconds count what the
    step records say; the step span carries them."""
    from dataclasses import replace

    telemetry, exporter = make()
    record = telemetry.begin("r5", "anon/r5", "generate")
    telemetry.admit(record, 1)
    t0 = time.monotonic()
    encoded = replace(
        step(7, {"anon/r5": 40}, t0), num_images_encoded=2, num_encoder_cache_hits=1,
        encoder_time=0.25,
    )  # fmt: skip
    telemetry.on_step(encoded)
    telemetry.on_step(replace(step(8, {"anon/r5": 40}, t0 + 0.02), num_encoder_cache_hits=3))
    text = telemetry.exposition().decode()
    value = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert value["tokenwire:mm_images_encoded_total"] == 2
    assert value["tokenwire:mm_encoder_cache_hits_total"] == 4
    assert value["tokenwire:mm_encoder_seconds_total"] == 0.25
    telemetry.on_request_finished(finished("anon/r5", t0, out=1))
    telemetry.end(record, "OK")
    spans = exporter.get_finished_spans()
    steps = [s for s in spans if s.attributes and s.attributes.get("tokenwire.step.id") == 7]
    assert steps and steps[0].attributes["tokenwire.step.images_encoded"] == 2
    assert steps[0].attributes["tokenwire.step.encoder_ms"] == 250.0


def test_kv_tier_loads_are_request_span_attributes() -> None:
    """A request whose prefix came back from a KV tier carries the tokens loaded and the
    loads' time on its span; one that loaded nothing carries neither."""
    from dataclasses import replace

    telemetry, exporter = make()
    for rid, loaded in (("r5", 28), ("r6", 0)):
        record = telemetry.begin(rid, f"anon/{rid}", "generate")
        telemetry.admit(record, 1)
        done = finished(f"anon/{rid}", time.monotonic())
        telemetry.on_request_finished(
            replace(done, num_tier_loaded_tokens=loaded, tier_load_time=0.004 if loaded else 0.0)
        )
        telemetry.end(record, "OK")
    spans = {
        s.attributes["tokenwire.request_id"]: s.attributes
        for s in exporter.get_finished_spans()
        if s.name == "tokenwire.request" and s.attributes
    }
    assert spans["r5"]["tokenwire.kv_tier.loaded_tokens"] == 28
    assert abs(float(spans["r5"]["tokenwire.kv_tier.load_time_s"]) - 0.004) < 1e-12
    assert "tokenwire.kv_tier.loaded_tokens" not in spans["r6"]
    assert "tokenwire.kv_tier.load_time_s" not in spans["r6"]
