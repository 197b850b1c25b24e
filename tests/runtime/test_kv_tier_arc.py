"""``--kv-offloading-eviction-policy arc`` through a real engine (docs/kv-tiers.md, "Eviction
policy"): a prefix that came back from the host tier once outlives a scan of unique prompts
that overflows the tier, and comes back again with the same greedy tokens and logprobs as a
run that never evicted; under the default LRU the same scan flushes it. The host tier and the
disk tier under it alike; every tier idle and consistent after."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_kv_offload import A, assert_same_choice, assert_tier_idle, one

from tokenwire.runtime.core.arc_tier import ArcTier
from tokenwire.runtime.core.host_tier import HostTier
from tokenwire.runtime.core.kv_connector import OffloadingConnector
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.stats import StepRecorder

# Unique 30-token prompts (7 full blocks of 4 each), none sharing a block with A or another:
# two that evict A from the device, then a scan of five.
UNIQUE = [[(i * 17 + 31 * k) % 101 + 405 for i in range(30)] for k in range(7)]
EVICTORS, SCAN = UNIQUE[:2], UNIQUE[2:]
TIER_SLOTS = 16  # A's 7 blocks and one step's saves (<= 8) fit; the scan's 35+ do not


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def block_bytes(model_dir: Path) -> int:
    probe = make_llm(model_dir, 0.001, "lru")
    connector = probe.engine.scheduler.connector
    assert isinstance(connector, OffloadingConnector)
    return connector.block_bytes


def make_llm(model_dir: Path, offload: float | None, policy: str, **tier: Any) -> LLM:
    return LLM(
        str(model_dir),
        device="cpu",
        max_model_len=64,
        block_size=4,
        num_gpu_blocks_override=17,  # 16 usable blocks of 4 tokens
        kv_offloading_size=offload,
        kv_offloading_eviction_policy=policy,
        observer=StepRecorder(),
        **tier,
    )


def tier_gib(block_bytes: int, slots: int) -> float:
    return slots * block_bytes / 2**30


def reuse_then_scan(llm: LLM) -> int:
    """A, evicted by two other prompts and loaded back (a tier hit), then a scan of prompts used
    once, then A again: the cached tokens of the last A."""
    one(llm, A)
    for prompt in EVICTORS:
        one(llm, prompt)
    assert one(llm, A).num_cached_tokens == 28  # back from the tier: ARC's frequent list
    for prompt in SCAN:
        one(llm, prompt)
    return one(llm, A).num_cached_tokens


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_reused_prefix_outlives_a_scan_under_arc_only(
    model_dir: Path, block_bytes: int, policy: str
) -> None:
    never_evicted = one(make_llm(model_dir, None, "lru"), A)
    llm = make_llm(model_dir, tier_gib(block_bytes, TIER_SLOTS), policy)
    connector = llm.engine.scheduler.connector
    assert isinstance(connector, OffloadingConnector)
    assert isinstance(connector.tier, ArcTier if policy == "arc" else HostTier)
    assert connector.stats().capacity_blocks == TIER_SLOTS
    cached = reuse_then_scan(llm)
    assert cached == (28 if policy == "arc" else 0)
    assert_same_choice(one(llm, A), never_evicted)
    assert_tier_idle(llm)


def test_the_disk_tier_evicts_by_arc_too(model_dir: Path, block_bytes: int, tmp_path: Path) -> None:
    """A one-slot host tier over a disk tier of TIER_SLOTS records: the disk tier's index is
    ARC's, and the reused prefix outlives the scan there."""
    never_evicted = one(make_llm(model_dir, None, "lru"), A)
    llm = make_llm(
        model_dir,
        tier_gib(block_bytes, 1),
        "arc",
        kv_offloading_disk_path=str(tmp_path),
        kv_offloading_disk_size=tier_gib(block_bytes, TIER_SLOTS),
    )
    connector = llm.engine.scheduler.connector
    assert isinstance(connector, OffloadingConnector) and connector.disk is not None
    assert isinstance(connector.disk.index, ArcTier)
    assert reuse_then_scan(llm) >= 24  # the host slot may hold one block; the rest: disk
    assert connector.stats().disk_blocks_loaded > 0
    assert_same_choice(one(llm, A), never_evicted)
    assert_tier_idle(llm)


def test_an_unknown_policy_is_refused_naming_the_flag() -> None:
    from tokenwire.runtime.engine_args import EngineArgs

    with pytest.raises(ValueError, match="--kv-offloading-eviction-policy"):
        EngineArgs(kv_offloading_eviction_policy="fifo").create_engine_config()  # type: ignore[arg-type]
