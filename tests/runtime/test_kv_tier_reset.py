"""``reset_prefix_cache`` and shutdown with the KV tiers (docs/kv-tiers.md): a reset forgets
every tier (device, host, disk) and zeroes the disk file's records, so neither this engine nor
a restarted one serves a block from before the reset; it is refused while a Session holds host
slots; a shutdown leaves only the disk tier's one file in its directory (no temporary file),
unlocked, with every write landed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_kv_disk_tier import assert_tiers_idle, connector_of, evict_a_to_disk, make_llm, tiered
from test_kv_offload import GREEDY, A, B, one

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.worker.kv_disk import disk_file


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def block_bytes(model_dir: Path) -> int:
    probe = make_llm(model_dir, None, 0.01)
    try:
        return int(probe.engine.facts.kv_block_bytes)
    finally:
        probe.shutdown()


@pytest.fixture
def llms() -> Iterator[list[LLM]]:
    made: list[LLM] = []
    yield made
    for llm in made:
        llm.shutdown()


def test_reset_clears_every_tier_and_the_disk_file(
    model_dir: Path, block_bytes: int, tmp_path: Path, llms: list[LLM]
) -> None:
    llm = tiered(model_dir, tmp_path, block_bytes, llms)
    evict_a_to_disk(llm)
    stats = connector_of(llm).stats()
    assert stats.used_blocks > 0 and stats.disk_used_blocks > 0
    assert llm.engine.reset_prefix_cache()
    stats = connector_of(llm).stats()
    assert stats.used_blocks == 0 and stats.disk_used_blocks == 0
    assert llm.engine.kv_cache_manager.block_pool.cached_hashes() == []
    assert one(llm, A).num_cached_tokens == 0  # no tier serves a block from before the reset
    assert_tiers_idle(llm)
    llm.shutdown()
    llms.remove(llm)
    assert sorted(p.name for p in tmp_path.iterdir()) == [disk_file(str(tmp_path), 0).name]

    # The lock was released, and no record from before the reset is taken over (A alone,
    # after it, left the device cache: nothing was written since).
    again = tiered(model_dir, tmp_path, block_bytes, llms)
    assert again.engine.facts.disk_entries == ()
    assert one(again, A).num_cached_tokens == 0


def test_reset_is_refused_while_a_session_holds_host_slots(
    model_dir: Path, block_bytes: int, tmp_path: Path, llms: list[LLM]
) -> None:
    llm = make_llm(model_dir, tmp_path, 64 * block_bytes / (1 << 30))  # 64 host blocks
    llms.append(llm)
    engine = llm.engine
    engine.add_request("s/0", list(A), GREEDY, hold_as="s")
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.reset_prefix_cache()  # its table is on the device
    one(llm, B)  # device pressure: the Session's table moves down to the host tier
    connector = connector_of(llm)
    assert engine.pop_evicted_holders() == [] and connector.tier.num_pinned >= 7
    assert not engine.reset_prefix_cache()  # refused: the Session holds host slots
    assert connector.tier.num_pinned >= 7 and connector.stats().used_blocks >= 7
    assert engine.release_holder("s")  # the Session closes
    assert engine.reset_prefix_cache()
    assert connector.stats().used_blocks == 0
    assert_tiers_idle(llm)
