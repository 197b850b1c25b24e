"""``DPBalancer``: Session holders stay on their core, prompts sharing a prefix follow it while
that core is not overloaded, new work goes to the least loaded core, and its maps forget every
request that ends (finished, aborted or failed to add). The merged stats snapshot sums the
cores and keeps each core's own; before the first step every core's blocks count."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest

from tokenwire.runtime.config import ParallelConfig
from tokenwire.runtime.engine.dp_balance import DPBalancer
from tokenwire.runtime.engine.dp_client import check_data_parallel
from tokenwire.runtime.engine.dp_merge import idle_snapshot, merge_snapshots
from tokenwire.runtime.engine.protocol import EngineInfo, EngineStatsSnapshot
from tokenwire.runtime.engine_args import EngineArgs
from tokenwire.runtime.kv_events_config import KVEventsConfig, rank_endpoint

BLOCK = 4


def _send(b: DPBalancer, parent: str, prompt: list[int], n: int = 1, **key: str | None) -> int:
    rank = b.choose(prompt, **key)
    b.assign(rank, parent, [f"{i}-{parent}" for i in range(n)], prompt, **key)
    return rank


def test_new_work_goes_to_the_least_loaded_core() -> None:
    b = DPBalancer(2, BLOCK)
    ranks = [_send(b, f"r{i}", [100 + i] * 8) for i in range(6)]  # distinct prompts
    assert ranks == [0, 1, 0, 1, 0, 1]
    assert b.in_flight() == [3, 3] and b.tracked() == 6
    for i in (0, 2, 4):
        b.finished(f"0-r{i}")
    assert b.in_flight() == [0, 3]
    assert _send(b, "next", [7] * 8) == 0


def test_shared_prefix_follows_its_core_within_the_slack() -> None:
    b = DPBalancer(2, BLOCK, slack=2)
    system = list(range(16))  # four full blocks
    first = _send(b, "a", [*system, 1, 2, 3])
    assert first == 0
    # Same prefix, another tail: same core while it carries at most 2 more than the other.
    assert [_send(b, f"p{i}", [*system, 50 + i]) for i in range(2)] == [0, 0]
    assert b.in_flight() == [3, 0]
    assert _send(b, "spill", [*system, 99]) == 1  # 3 > 0 + 2: the load wins
    assert _send(b, "other", [9] * 16) == 1  # no shared prefix: the least loaded core


def test_cache_salt_and_adapter_separate_prefixes() -> None:
    b = DPBalancer(2, BLOCK, slack=8)
    prompt = list(range(12))
    assert _send(b, "a", prompt, cache_salt="tenant-a") == 0
    assert _send(b, "b", prompt, cache_salt="tenant-b") == 1  # not tenant-a's prefix
    assert _send(b, "c", prompt, cache_salt="tenant-a") == 0
    assert _send(b, "d", prompt, lora_name="adapter") == 1  # rank 1: in flight 1 vs 2


def test_session_holder_stays_on_its_core_whatever_the_load() -> None:
    b = DPBalancer(2, BLOCK, slack=0)
    assert _send(b, "t1", [1] * 8, holder="session/x") == 0
    for i in range(5):  # load piles up on the holder's core
        b.assign(0, f"bulk{i}", [f"0-bulk{i}"], [200 + i] * 8)
    assert _send(b, "t2", [1] * 8 + [2] * 8, holder="session/x") == 0
    assert b.holder_rank("session/x") == 0
    assert b.release_holder("session/x") == 0
    assert b.release_holder("session/x") is None


def test_failed_add_and_unknown_ids_leave_nothing_behind() -> None:
    b = DPBalancer(2, BLOCK, affinity_entries=3)
    _send(b, "n3", [5] * 8, n=3)
    assert b.tracked() == 3
    b.failed("n3")
    b.finished("never-sent")
    assert b.tracked() == 0 and b.in_flight() == [0, 0]
    for i in range(10):  # the affinity map stays bounded
        _send(b, f"q{i}", [i] * 16)
        b.finished(f"0-q{i}")
    assert len(b._prefixes) == 3


def test_offline_llm_refuses_data_parallel() -> None:
    from tokenwire.runtime.llm import LLM

    with pytest.raises(ValueError, match="--data-parallel-size"):
        LLM(data_parallel_size=2)


def test_parallel_config_checks_the_data_parallel_size() -> None:
    assert ParallelConfig(data_parallel_size=2).cpu_ranks_per_node == 2
    with pytest.raises(ValueError, match="data_parallel_size"):
        ParallelConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        ParallelConfig(data_parallel_size=2, data_parallel_rank=2)
    null_events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    no_port = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://host")
    vllm_ports = KVEventsConfig(  # vLLM's documented pair: rank 1's PUB lands on rank 0's replay
        enable_kv_cache_events=True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558"
    )
    for refused, flag in (
        ({"tensor_parallel_size": 2}, "--tensor-parallel-size"),
        ({"kv_events_config": no_port}, "port"),
        ({"kv_events_config": vllm_ports}, "rank 1's endpoint 'tcp://\\*:5558' is also rank 0's"),
    ):
        config = EngineArgs(data_parallel_size=2, **refused).create_engine_config()
        with pytest.raises(ValueError, match=flag):
            check_data_parallel(config)
    zmq_events = KVEventsConfig(enable_kv_cache_events=True)  # per-rank ZMQ endpoints: served
    for served in (zmq_events, null_events):  # null: the merged gRPC stream only
        check_data_parallel(
            EngineArgs(data_parallel_size=2, kv_events_config=served).create_engine_config()
        )


def test_each_rank_publishes_kv_events_on_its_own_endpoints() -> None:
    """vLLM's offset_endpoint_port: the port plus the rank, ipc/inproc names with _dp{rank}."""
    events = KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://*:5557", replay_endpoint="tcp://[::1]:6000"
    )
    assert events.for_rank(0) == events
    rank2 = events.for_rank(2)
    assert (rank2.endpoint, rank2.replay_endpoint) == ("tcp://*:5559", "tcp://[::1]:6002")
    assert rank_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert rank_endpoint("inproc://kv", 3) == "inproc://kv_dp3"
    assert rank_endpoint("tcp://127.0.0.1:*", 1) == "tcp://127.0.0.1:*"  # ephemeral: its own
    with pytest.raises(ValueError, match="port"):
        rank_endpoint("tcp://127.0.0.1:65535", 1)


def test_merged_snapshots_sum_the_cores_and_keep_each() -> None:
    a = EngineStatsSnapshot(num_running=2, kv_cache_usage=0.5, kv_blocks_free=5, kv_blocks_total=10)
    b = EngineStatsSnapshot(num_waiting=1, kv_blocks_free=30, kv_blocks_total=30)
    merged = merge_snapshots([a, b])
    assert (merged.num_running, merged.num_waiting) == (2, 1)
    assert (merged.kv_blocks_free, merged.kv_blocks_total) == (35, 40)
    assert merged.kv_cache_usage == pytest.approx(5 / 40) and merged.ranks == (a, b)


def test_the_idle_snapshot_counts_every_cores_blocks() -> None:
    """Before any step the front's snapshot is every core's KV, not rank 0's alone."""
    two = idle_snapshot(
        cast(EngineInfo, SimpleNamespace(num_kv_blocks=10, rank_kv_blocks=(10, 12)))
    )
    assert (two.kv_blocks_free, two.kv_blocks_total) == (22, 22)
    assert [r.kv_blocks_total for r in two.ranks] == [10, 12]
    one = idle_snapshot(cast(EngineInfo, SimpleNamespace(num_kv_blocks=10, rank_kv_blocks=())))
    assert (one.kv_blocks_free, one.kv_blocks_total, one.ranks) == (10, 10, ())
