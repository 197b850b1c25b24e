"""The KV tiers under tensor parallelism (docs/kv-tiers.md): with TP=2 (gloo, real worker
processes) each rank moves its own shard of every block; a prefix evicted to the host tier
or the disk tier comes back with the same tokens and logprobs as a TP=2 run that never
evicted; a disk record damaged on one rank only is a miss on both (recomputed, never read);
a rank killed while a load is planned ends the engine and leaves no process behind."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from test_kv_offload import A, B, C, assert_same_choice, connector_hashes, one

from tokenwire.runtime.core.kv_connector import OffloadingConnector
from tokenwire.runtime.executor.multiproc import MultiprocExecutor, WorkerDeadError
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.worker.kv_disk import HEADER_BYTES, disk_file, record_bytes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture
def llms() -> Iterator[list[LLM]]:
    made: list[LLM] = []
    yield made
    for llm in made:
        pids = pids_of(llm)
        llm.shutdown()
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        assert not left, left


def pids_of(llm: LLM) -> list[int]:
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor)
    return list(executor.pids)


def tp2(model_dir: Path, llms: list[LLM], host_gib: float | None, **kw: Any) -> LLM:
    # 16 usable blocks of 4 tokens: two 36-token sequences do not fit together.
    llm = LLM(
        str(model_dir),
        device="cpu",
        tensor_parallel_size=2,
        max_model_len=64,
        block_size=4,
        num_gpu_blocks_override=17,
        kv_offloading_size=host_gib,
        **kw,
    )
    llms.append(llm)
    return llm


def connector_of(llm: LLM) -> OffloadingConnector:
    connector = llm.engine.scheduler.connector
    assert isinstance(connector, OffloadingConnector)
    return connector


def test_tp2_prefix_restored_from_the_host_tier(model_dir: Path, llms: list[LLM]) -> None:
    never_evicted = one(tp2(model_dir, llms, None), A)
    llm = tp2(model_dir, llms, 0.01)
    for prompt in (A, B, C):  # A's blocks leave the device for the host tier
        one(llm, prompt)
    again = one(llm, A)
    assert again.num_cached_tokens == 28  # every full block before the last token
    stats = connector_of(llm).stats()
    assert stats.blocks_loaded == 7 and stats.bytes_loaded == 7 * connector_of(llm).block_bytes
    assert_same_choice(again, never_evicted)
    connector_of(llm).check_invariants(idle=True)


def test_tp2_disk_record_damaged_on_one_rank_is_a_miss_on_both(
    model_dir: Path, llms: list[LLM], tmp_path: Path
) -> None:
    never_evicted = one(tp2(model_dir, llms, None), A)
    host = tp2(model_dir, llms, 0.01)  # the whole group's bytes of one block
    block_bytes = host.engine.facts.kv_block_bytes
    llm = tp2(
        model_dir,
        llms,
        2 * block_bytes / (1 << 30),  # two blocks: most of A goes on to the disk
        kv_offloading_disk_path=str(tmp_path),
        kv_offloading_disk_size=1 / 1024,
    )
    for prompt in (A, B, C):
        one(llm, prompt)
    connector = connector_of(llm)
    assert connector.disk is not None
    hashes = connector_hashes(llm, A)
    on_disk = [
        (i, connector.disk.index._lru[h])
        for i, h in enumerate(hashes)
        if h not in connector.tier and h in connector.disk.index
    ]
    assert len(on_disk) >= 5
    index, slot = on_disk[0]
    files = [disk_file(str(tmp_path), 0, rank, 2) for rank in (0, 1)]
    assert all(f.exists() for f in files)  # one file per rank, each its own shard
    offset = slot * record_bytes(block_bytes // 2) + HEADER_BYTES + 17
    with files[1].open("r+b") as f:  # rank 1's copy of the record only
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = one(llm, A)
    assert again.num_cached_tokens == 4 * index  # the blocks before the damaged one
    assert_same_choice(again, never_evicted)  # rank 0's good copy was not used either
    assert connector.stats().disk_load_failures == 1
    assert hashes[index] not in connector.disk.index
    connector.check_invariants(idle=True)


def test_tp2_rank_killed_with_a_load_planned_ends_the_engine(
    model_dir: Path, llms: list[LLM]
) -> None:
    llm = tp2(model_dir, llms, 0.01)
    for prompt in (A, B, C):
        one(llm, prompt)
    pids = pids_of(llm)
    psutil.Process(pids[1]).kill()
    with pytest.raises(WorkerDeadError):  # rank 0's next collective fails
        one(llm, A)  # its first step plans the load of A's blocks
