"""The host KV tier's stats record as ``tokenwire:kv_offload_*`` series; none when off."""

from __future__ import annotations

from prometheus_client import generate_latest

from tokenwire.runtime.stats import KVOffloadStats
from tokenwire.server.telemetry.engine_gauges import EngineGauges
from tokenwire.server.telemetry.metrics import EngineMetrics


def scrape(gauges: EngineGauges) -> str:
    return generate_latest(EngineMetrics("m", lambda: gauges).registry).decode()


def test_kv_offload_series_follow_the_stats_record() -> None:
    tier = KVOffloadStats(
        capacity_blocks=10, used_blocks=3, blocks_saved=4, blocks_loaded=2, bytes_saved=400,
        bytes_loaded=200, load_time=0.5, disk_capacity_blocks=20, disk_used_blocks=6,
        disk_blocks_loaded=5, disk_bytes_saved=700, disk_bytes_loaded=500, disk_load_failures=1,
    )  # fmt: skip
    text = scrape(EngineGauges(0, 0, 0.0, kv_offload=tier))
    assert 'tokenwire:kv_offload_capacity_blocks{model_name="m"} 10.0' in text
    assert 'tokenwire:kv_offload_used_blocks{model_name="m"} 3.0' in text
    assert 'tokenwire:kv_offload_hit_blocks_total{model_name="m"} 2.0' in text
    assert 'tokenwire:kv_offload_saved_bytes_total{model_name="m"} 400.0' in text
    assert 'tokenwire:kv_offload_loaded_bytes_total{model_name="m"} 200.0' in text
    assert 'tokenwire:kv_offload_load_seconds_total{model_name="m"} 0.5' in text
    assert 'tokenwire:kv_offload_disk_capacity_blocks{model_name="m"} 20.0' in text
    assert 'tokenwire:kv_offload_disk_used_blocks{model_name="m"} 6.0' in text
    assert 'tokenwire:kv_offload_disk_hit_blocks_total{model_name="m"} 5.0' in text
    assert 'tokenwire:kv_offload_disk_saved_bytes_total{model_name="m"} 700.0' in text
    assert 'tokenwire:kv_offload_disk_loaded_bytes_total{model_name="m"} 500.0' in text
    assert 'tokenwire:kv_offload_disk_load_failures_total{model_name="m"} 1.0' in text


def test_no_kv_offload_series_when_the_tier_is_off() -> None:
    assert "kv_offload" not in scrape(EngineGauges(0, 0, 0.0))


def test_the_tier_stats_cross_the_core_process_codec() -> None:
    from tokenwire.runtime.engine.messages import StepResult
    from tokenwire.runtime.engine.protocol import EngineStatsSnapshot
    from tokenwire.runtime.ipc.codec import OutputCodec

    codec = OutputCodec()
    tier = KVOffloadStats(capacity_blocks=5, blocks_loaded=2, load_time=0.25, disk_used_blocks=3)
    message = StepResult([], [], [], [], [], EngineStatsSnapshot(kv_offload=tier))
    decoded = codec.decode(codec.encode(message))
    assert decoded.snapshot.kv_offload == tier
