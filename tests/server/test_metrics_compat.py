"""``--metrics-compat``: which prefixes the scrape-time series carry, and a bad value's
message (the full served check with real scrapes is tests/e2e/test_fleet_serve.py); with
several engine cores the gauges carry vLLM's ``engine`` label, with one they carry none (a
DP=2 server's scrape: tests/e2e/test_data_parallel_ranks.py)."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenwire.server.telemetry.engine_gauges import EngineGauges
from tokenwire.server.telemetry.metrics import EngineMetrics

STATE = EngineGauges(
    3, 1, 0.25, max_loras=2, prefix_cache_queries=100, prefix_cache_hits=40,
    cache_config=(("block_size", "16"), ("num_gpu_blocks", "512")),
)  # fmt: skip


def _names(compat: str) -> dict[str, float]:
    text = EngineMetrics("m", lambda: STATE, compat).exposition().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_vllm_only() -> None:
    names = _names("vllm")
    assert names["vllm:num_requests_running"] == 3 and names["vllm:num_requests_waiting"] == 1
    assert names["vllm:kv_cache_usage_perc"] == 0.25 and names["vllm:cache_config_info"] == 1
    assert names["vllm:prefix_cache_queries_total"] == 100
    assert names["vllm:prefix_cache_hits_total"] == 40
    assert "vllm:lora_requests_info" in names
    assert "tokenwire:num_requests_running" not in names


def test_tokenwire_only_and_both() -> None:
    assert not any(n.startswith("vllm:") for n in _names("tokenwire"))
    both = _names("both")
    assert both["tokenwire:num_requests_running"] == both["vllm:num_requests_running"] == 3


def test_bad_value_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--metrics-compat"):
        EngineMetrics("m", lambda: STATE, "prometheus")


def test_one_core_has_no_engine_label_and_several_have_one_series_each() -> None:
    one = EngineMetrics("m", lambda: STATE, "both").exposition().decode()
    assert "engine=" not in one
    ranks = (dataclasses.replace(STATE, num_running=1), dataclasses.replace(STATE, num_running=2))
    state = dataclasses.replace(STATE, ranks=ranks)
    text = EngineMetrics("m", lambda: state, "both").exposition().decode()
    for family in text_string_to_metric_families(text):
        if family.name in ("vllm:num_requests_running", "tokenwire:num_requests_running"):
            samples = {s.labels["engine"]: s.value for s in family.samples}
            assert samples == {"0": 1.0, "1": 2.0}
        if family.name == "vllm:prefix_cache_queries":  # counters stay server-wide
            assert [s.labels for s in family.samples] == [{"model_name": "m"}]
