"""The disk KV tier (``--kv-offloading-disk-path``, docs/kv-tiers.md) on a real engine (tiny
random Llama, CPU): blocks the host tier evicts go to disk and come back (disk -> device) with
the same greedy tokens and logprobs as a run that never evicted; a corrupt or truncated record
is ignored (a miss), invalidated and never served; an abort during a disk load leaves every
block free on every tier; a restarted engine reuses the file when its fingerprint matches,
and ignores it when the layout differs."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_checks import assert_llm_idle
from test_kv_offload import GREEDY, A, B, C, assert_same_choice, connector_hashes, one

from tokenwire.runtime.core.kv_connector import OffloadingConnector
from tokenwire.runtime.engine.core_loop import snapshot
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.worker.kv_disk import HEADER_BYTES, DiskStore, disk_file
from tokenwire.runtime.worker.worker import Worker

HOST_BLOCKS = 2  # a tiny host tier: most of A's blocks go on to the disk


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def block_bytes(model_dir: Path) -> int:
    llm = make_llm(model_dir, None, 0.01)
    try:
        return llm.engine.facts.kv_block_bytes
    finally:
        llm.shutdown()


@pytest.fixture
def llms() -> Iterator[list[LLM]]:
    made: list[LLM] = []
    yield made
    for llm in made:
        llm.shutdown()


def make_llm(model_dir: Path, disk: Path | None, host_gib: float, **kw: Any) -> LLM:
    return LLM(
        str(model_dir),
        device="cpu",
        max_model_len=64,
        block_size=4,
        num_gpu_blocks_override=17,
        kv_offloading_size=host_gib,
        kv_offloading_disk_path=None if disk is None else str(disk),
        kv_offloading_disk_size=None if disk is None else 1 / 1024,  # 1 MiB
        **kw,
    )


def tiered(model_dir: Path, disk: Path, block_bytes: int, llms: list[LLM], **kw: Any) -> LLM:
    llm = make_llm(model_dir, disk, HOST_BLOCKS * block_bytes / (1 << 30), **kw)
    llms.append(llm)
    return llm


def connector_of(llm: LLM) -> OffloadingConnector:
    connector = llm.engine.scheduler.connector
    assert isinstance(connector, OffloadingConnector) and connector.disk is not None
    return connector


def assert_tiers_idle(llm: LLM) -> None:
    assert_llm_idle(llm)
    connector_of(llm).check_invariants(idle=True)  # host and disk: nothing pinned or queued


def evict_a_to_disk(llm: LLM) -> list[bytes]:
    """Run A, then B and C (A's blocks leave the device, then the 2-block host tier)."""
    for prompt in (A, B, C):
        one(llm, prompt)
    hashes = connector_hashes(llm, A)
    connector = connector_of(llm)
    assert connector.disk is not None
    assert sum(h in connector.disk.index for h in hashes) >= 5
    assert all(llm.engine.kv_cache_manager.block_pool.get_cached_block(h) is None for h in hashes)
    return hashes


def test_prefix_restored_from_disk_matches_a_run_that_never_evicted(
    model_dir: Path, block_bytes: int, tmp_path: Path, llms: list[LLM]
) -> None:
    never_evicted = one(make_llm(model_dir, None, 0.0), A)
    llm = tiered(model_dir, tmp_path, block_bytes, llms)
    evict_a_to_disk(llm)
    stats = connector_of(llm).stats()
    assert stats.capacity_blocks == HOST_BLOCKS and stats.disk_capacity_blocks > 7
    assert stats.disk_blocks_saved >= 5 and stats.disk_bytes_saved == 0 + (
        stats.disk_blocks_saved * block_bytes
    )
    again = one(llm, A)
    assert again.num_cached_tokens == 28  # every full block, from the host tier or the disk
    stats = connector_of(llm).stats()
    assert stats.disk_blocks_loaded >= 5 and stats.disk_load_failures == 0
    assert stats.disk_bytes_loaded == stats.disk_blocks_loaded * block_bytes
    assert 0 < stats.disk_used_blocks <= stats.disk_capacity_blocks
    assert_same_choice(again, never_evicted)
    assert_tiers_idle(llm)
    assert snapshot(llm.engine, 0).kv_offload == stats  # what the metrics read


def first_on_disk(llm: LLM, hashes: list[bytes]) -> tuple[int, int]:
    """(index in A's blocks, disk slot) of the first of A's blocks held only on disk."""
    connector = connector_of(llm)
    assert connector.disk is not None
    for i, block_hash in enumerate(hashes):
        if block_hash not in connector.tier and block_hash in connector.disk.index:
            slot = connector.disk.index._lru[block_hash]
            return i, slot
    raise AssertionError("none of A's blocks is only on disk")


@pytest.mark.parametrize("damage", ["flip_payload_byte", "truncate_file"])
def test_a_corrupt_record_is_a_miss_never_served(
    model_dir: Path, block_bytes: int, tmp_path: Path, llms: list[LLM], damage: str
) -> None:
    never_evicted = one(make_llm(model_dir, None, 0.0), A)
    llm = tiered(model_dir, tmp_path, block_bytes, llms)
    hashes = evict_a_to_disk(llm)
    index, slot = first_on_disk(llm, hashes)
    store = disk_store(llm)
    offset = slot * store.record_bytes
    path = disk_file(str(tmp_path), 0)
    if damage == "flip_payload_byte":
        with path.open("r+b") as f:
            f.seek(offset + HEADER_BYTES + 17)
            byte = f.read(1)
            f.seek(offset + HEADER_BYTES + 17)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:  # the record is cut short
        with path.open("r+b") as f:
            f.truncate(offset + HEADER_BYTES + 5)
    again = one(llm, A)
    assert again.num_cached_tokens == 4 * index  # the blocks before the bad one
    assert_same_choice(again, never_evicted)  # the bad block was recomputed, not read
    stats = connector_of(llm).stats()
    # A cut file loses the records after the cut too: each is a miss of its own.
    want = range(1, 2) if damage == "flip_payload_byte" else range(1, 100)
    assert stats.disk_load_failures in want
    connector = connector_of(llm)
    assert connector.disk is not None and hashes[index] not in connector.disk.index
    assert hashes[index] not in dict(store.scan())  # invalidated: no restart takes it over
    assert_tiers_idle(llm)


def disk_store(llm: LLM) -> DiskStore:
    worker = llm.engine.executor.worker  # type: ignore[attr-defined]
    assert isinstance(worker, Worker) and worker.offload is not None
    assert worker.offload.disk is not None
    return worker.offload.disk


def test_abort_during_a_disk_load_frees_every_block_on_every_tier(
    model_dir: Path, block_bytes: int, tmp_path: Path, llms: list[LLM]
) -> None:
    llm = tiered(model_dir, tmp_path, block_bytes, llms)
    evict_a_to_disk(llm)
    store = disk_store(llm)
    gate = threading.Event()
    read = store.read

    def slow_read(slot: int, block_hash: bytes) -> bytes | None:
        gate.wait(10)
        return read(slot, block_hash)

    store.read = slow_read  # type: ignore[method-assign]
    engine = llm.engine
    engine.add_request("a2", list(A), GREEDY)
    engine.add_request("c2", list(C[:9]), GREEDY)
    connector = connector_of(llm)
    for _ in range(3):
        engine.step()
    assert connector.waiting_for_load("a2") and connector.has_pending
    engine.abort_requests(["a2"])
    assert engine.has_unfinished_requests()  # the disk read is still landing in its blocks
    gate.set()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    store.read = read  # type: ignore[method-assign]
    assert_tiers_idle(llm)
    assert connector.stats().loads_in_flight == 0


def test_a_restarted_engine_reuses_the_disk_tier_only_for_the_same_layout(
    model_dir: Path, block_bytes: int, tmp_path: Path, llms: list[LLM]
) -> None:
    never_evicted = one(make_llm(model_dir, None, 0.0), A)
    first = tiered(model_dir, tmp_path, block_bytes, llms)
    hashes = evict_a_to_disk(first)
    on_disk = [h for h in hashes if h in connector_of(first).disk.index]  # type: ignore[union-attr]
    first.shutdown()  # writes drained, the file's lock released
    llms.remove(first)

    second = tiered(model_dir, tmp_path, block_bytes, llms)
    restored = dict(second.engine.facts.disk_entries)
    assert set(on_disk) <= set(restored)
    assert connector_of(second).stats().disk_used_blocks == len(restored)
    again = one(second, A)  # A's leading blocks were on disk: a hit across the restart
    leading = next((i for i, h in enumerate(hashes) if h not in restored), len(hashes))
    assert again.num_cached_tokens == 4 * leading > 0
    assert_same_choice(again, never_evicted)
    assert_tiers_idle(second)
    second.shutdown()
    llms.remove(second)

    other = tiered(model_dir, tmp_path, block_bytes, llms, kv_cache_dtype="fp8")
    assert other.engine.facts.disk_entries == ()  # another layout: nothing is taken over
    assert one(other, A).num_cached_tokens == 0


def test_two_servers_never_share_a_disk_file(tmp_path: Path) -> None:
    path = disk_file(str(tmp_path), 0)
    store = DiskStore(path, 4, 100, b"f" * 16)
    try:
        with pytest.raises(ValueError, match="in use by another server"):
            DiskStore(path, 4, 100, b"f" * 16)
        store.write(1, b"h" * 32, b"x" * 100)
        assert store.read(1, b"h" * 32) == b"x" * 100
        assert store.read(1, b"g" * 32) is None  # another hash's record: ignored, invalidated
        assert store.read(1, b"h" * 32) is None
    finally:
        store.close()
    other = DiskStore(path, 4, 100, b"e" * 16)  # another fingerprint: nothing restored
    try:
        other.write(2, b"k" * 32, b"y" * 100)
        assert other.scan() == [(b"k" * 32, 2)]
    finally:
        other.close()
