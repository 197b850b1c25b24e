"""KV-cache events in vLLM's schema (issue 28 item 2), end to end on a real engine.

A tiny llama with few KV blocks runs a random workload (shared prefixes = prefix hits,
more sequences than blocks = preemptions and evictions, aborts, a prefix-cache reset). A ZMQ
subscriber decodes every batch with a *copy of vLLM's own Struct definitions* (not
tokenwire's classes), fills the gaps PUB/SUB loses through the ROUTER replay socket, and
rebuilds the cached block set; it must equal the KV cache manager's own map. A late
subscriber of the front's hub starts from a snapshot and gets the same set; a router
recomputes a prompt's block hashes from its token ids with the recipe of docs/fleet.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from kv_subscriber import Subscriber, apply
from tiny_models import TEST_KV_CACHE_BYTES
from vllm_kv_schema import BlockStored

from tokenwire.runtime.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from tokenwire.runtime.core.kv_connector import OffloadingConnector
from tokenwire.runtime.core.kv_events import external_block_hash
from tokenwire.runtime.engine.async_engine import AsyncEngine
from tokenwire.runtime.engine.inproc_client import InprocCoreClient
from tokenwire.runtime.front.kv_events_front import KVEventsFront
from tokenwire.runtime.front.request_stream import RequestFailed, RequestFinished
from tokenwire.runtime.kv_events_config import KVEventsConfig
from tokenwire.runtime.sampling_params import SamplingParams

BLOCK_SIZE = 4


def recompute_hashes(tokens: list[int], cache_salt: str | None = None) -> list[int]:
    """docs/fleet.md's recipe, written from the doc alone."""
    out, parent = [], b""
    for i in range(len(tokens) // BLOCK_SIZE):
        block = tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        extra = b"" if i or cache_salt is None else b"salt:" + cache_salt.encode()
        parent = hashlib.sha256(parent + struct.pack(f"<{BLOCK_SIZE}I", *block) + extra).digest()
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def engine_config(model: Path, **cache: Any) -> EngineConfig:
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv",
    )
    return EngineConfig(
        model=ModelConfig(model=str(model), max_model_len=96, served_model_name="tiny"),
        cache=CacheConfig(
            block_size=BLOCK_SIZE,
            num_gpu_blocks_override=48,
            kv_cache_memory=TEST_KV_CACHE_BYTES,
            **cache,
        ),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        kv_events_config=events,
        device="cpu",
    )


async def run_request(engine: AsyncEngine, rid: str, tokens: list[int], rng: random.Random) -> str:
    """The finish reason of the request's choice ("cancelled" for the ~20% it aborts)."""
    params = SamplingParams(max_tokens=rng.randint(2, 10), temperature=0.0, ignore_eos=True)
    stream = engine.add_request(rid, None, tokens, params, cache_salt=rng.choice([None, "t1"]))
    abort_after = rng.random() < 0.2
    async for item in stream:
        if abort_after:
            engine.abort(rid)
        if isinstance(item, RequestFailed):
            return "failed"
        if isinstance(item, RequestFinished):
            return str(item.output.outputs[0].finish_reason)
    return "none"


async def workload(engine: AsyncEngine, rng: random.Random, n: int, tag: str) -> list[str]:
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.randint(8, 24))] for _ in range(3)]
    tasks = []
    for i in range(n):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(rng.randint(1, 40))]
        tasks.append(run_request(engine, f"{tag}-{i}", prompt, rng))
    return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout=120))


def core_blocks(engine: AsyncEngine) -> set[int]:
    client = engine.client
    assert isinstance(client, InprocCoreClient) and client.core is not None
    pool = client.core.kv_cache_manager.block_pool
    return {external_block_hash(h) for h in pool.cached_hashes()}


async def scenario(
    model: Path, check: Callable[[AsyncEngine, Subscriber], Any], **cache: Any
) -> None:
    engine = AsyncEngine(engine_config(model, **cache), in_process=True, max_requests=64)
    await engine.start()
    await engine.warmup()
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        publisher = engine._kv_events.publisher if engine._kv_events else None
        assert publisher is not None and publisher.replay_endpoint is not None
        sub = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint)
        await check(engine, sub)
    finally:
        ctx.destroy(linger=0)
        await engine.shutdown()


def test_subscriber_rebuilds_the_cached_block_set(tiny_model_factory: Callable[..., Path]) -> None:
    async def check(engine: AsyncEngine, sub: Subscriber) -> None:
        rng = random.Random(7)
        hub = engine.kv_events
        assert hub is not None
        reasons = await workload(engine, rng, 24, "a")
        idle = await engine.check_idle()
        assert idle.num_free_blocks == idle.num_blocks
        assert await engine.reset_prefix_cache()
        reasons += await workload(engine, rng, 24, "b")
        assert any("cancel" in r.lower() for r in reasons), reasons  # aborts happened
        report = await engine.check_idle()
        assert not report.has_unfinished_requests and report.invariant_error is None
        stats = engine.stats_snapshot()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        await asyncio.to_thread(sub.drain)
        replayed = await asyncio.to_thread(sub.replay_from, 1)
        assert replayed == list(range(1, hub.last_seq + 1))  # the whole run is buffered
        kinds = {type(e).__name__ for b in sub.batches.values() for e in b.events}
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
        expected = core_blocks(engine)
        assert expected and sub.blocks() == expected
        assert hub.cached_block_hashes == expected
        # A late subscriber: snapshot (as of last_seq) first, then live batches.
        late = hub.subscribe(0)
        first = await anext(late)
        assert first.snapshot and first.seq == hub.last_seq
        late_blocks: set[int] = set()
        apply(late_blocks, first.batch)
        assert late_blocks == expected
        # Live from there on: one more request's batch arrives after the snapshot.
        tokens = [rng.randrange(1, 500) for _ in range(13)]
        await run_request(engine, "late", tokens, random.Random(1))
        nxt = await asyncio.wait_for(anext(late), 10)
        assert nxt.seq == first.seq + 1 and not nxt.snapshot
        await late.aclose()
        # Replay from a number inside the buffer returns exactly the later batches.
        await asyncio.to_thread(sub.drain)
        assert await asyncio.to_thread(sub.replay_from, hub.last_seq) == [hub.last_seq]

    asyncio.run(scenario(tiny_model_factory("llama"), check))


def test_router_recomputes_block_hashes(tiny_model_factory: Callable[..., Path]) -> None:
    async def check(engine: AsyncEngine, sub: Subscriber) -> None:
        tokens = list(range(10, 31))  # 21 tokens: 5 full blocks
        for salt in (None, "tenant:acme"):
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            stream = engine.add_request(f"r-{salt}", None, tokens, params, cache_salt=salt)
            async for _item in stream:
                pass
        await engine.check_idle()
        await asyncio.to_thread(sub.replay_from, 1)
        stored = [e for b in sub.batches.values() for e in b.events if isinstance(e, BlockStored)]
        *_warmup, plain, salted = stored
        assert plain.block_hashes == recompute_hashes(tokens)
        assert salted.block_hashes == recompute_hashes(tokens, "tenant:acme")[:5]
        assert salted.extra_keys == [("salt:tenant:acme",), None, None, None, None]
        assert plain.parent_block_hash is None and plain.token_ids == tokens[:20]
        assert plain.medium == "GPU" and plain.block_size == BLOCK_SIZE

    asyncio.run(scenario(tiny_model_factory("llama"), check))


@pytest.mark.parametrize("disk", [False, True], ids=["host-tier", "host-and-disk-tiers"])
def test_kv_tiers_report_the_blocks_they_hold(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, disk: bool
) -> None:
    """With KV tiers (issue 29 item 6) the host tier's blocks are events with medium "CPU"
    and the disk tier's "DISK", vLLM's offloading form (no tokens, no parent): a subscriber
    rebuilds each tier's set, equal to the tier's own index, and the device set as before."""

    async def check(engine: AsyncEngine, sub: Subscriber) -> None:
        reasons = await workload(engine, random.Random(11), 32, "t")
        assert "failed" not in reasons
        await engine.check_idle()
        await asyncio.to_thread(sub.drain)
        await asyncio.to_thread(sub.replay_from, 1)
        connector = core_of(engine).scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        host = {external_block_hash(h) for h in connector.tier._lru}
        assert host and sub.blocks("CPU") == host
        assert sub.blocks() == core_blocks(engine)
        stored = [e for b in sub.batches.values() for e in b.events if isinstance(e, BlockStored)]
        tier_events = [e for e in stored if e.medium != "GPU"]
        assert all(e.token_ids == [] and e.parent_block_hash is None for e in tier_events)
        hub = engine.kv_events
        assert hub is not None and hub.tier_block_hashes("CPU") == host
        assert hub.cached_block_hashes == core_blocks(engine)
        if disk:
            assert connector.disk is not None
            on_disk = {external_block_hash(h) for h in connector.disk.index._lru}
            assert on_disk and sub.blocks("DISK") == on_disk == hub.tier_block_hashes("DISK")
        else:
            assert sub.blocks("DISK") == set()

    tiny = 64 * 1024 / (1 << 30)  # a few blocks of host tier: it evicts too
    tiers: dict[str, Any] = {"kv_offloading_size": tiny}
    if disk:
        tiers |= {"kv_offloading_disk_path": str(tmp_path), "kv_offloading_disk_size": 1 / 1024}
    asyncio.run(scenario(tiny_model_factory("llama"), check, **tiers))


def core_of(engine: AsyncEngine) -> Any:
    client = engine.client
    assert isinstance(client, InprocCoreClient) and client.core is not None
    return client.core


def test_events_off_by_default_cost_nothing(tiny_model_factory: Callable[..., Path]) -> None:
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_factory("llama")), max_model_len=96),
        cache=CacheConfig(kv_cache_memory=TEST_KV_CACHE_BYTES),
        device="cpu",
    )
    engine = AsyncEngine(config, in_process=True)
    assert engine.kv_events is None


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"publisher": "kafka"}', "publisher"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"endpoint": 5}', "endpoint"),
        ('{"bogus": 1}', "bogus"),
    ],
)
def test_bad_kv_events_config_names_the_key(text: str, key: str) -> None:
    from tokenwire.runtime.engine_args import EngineArgs

    with pytest.raises(ValueError, match=f"--kv-events-config.*{key}"):
        EngineArgs(kv_events_config=text).create_engine_config()  # type: ignore[arg-type]


def test_events_cross_the_process_codec() -> None:
    """The engine-core process sends them inside its ``StepResult`` (msgspec, no pickle)."""
    from tokenwire.runtime.core import kv_events as ev
    from tokenwire.runtime.engine.messages import StepResult
    from tokenwire.runtime.ipc.codec import OutputCodec

    batch = ev.KVEventBatch(
        ts=1.5,
        events=[
            ev.BlockStored(
                [2**64 - 1, 5], None, [1, 2, 3, 4] * 2, 4, 3, "GPU", "a", [("x",), None]
            ),
            ev.BlockRemoved([7], "GPU"),
            ev.AllBlocksCleared(),
        ],
    )
    codec = OutputCodec()
    decoded = codec.decode_output(codec.encode(StepResult(kv_events=batch)))
    assert isinstance(decoded, StepResult) and decoded.kv_events == batch


def test_a_rank_whose_port_is_taken_fails_startup_and_closes_the_others() -> None:
    """Rank 1 publishes on the port plus 1: taken, startup fails naming rank 1's endpoint, and
    rank 0's sockets (already bound) are closed again."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        blocker, taken = _taken_port_after_a_free_one(ctx)
        events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{taken - 1}")
        config = EngineConfig(
            parallel=ParallelConfig(data_parallel_size=2), kv_events_config=events, device="cpu"
        )
        front = KVEventsFront(config)
        with pytest.raises(ValueError, match=f"'tcp://\\*:{taken}'.*data-parallel rank 1"):
            front.start()
        assert front.publishers == []
        again = ctx.socket(zmq.PUB)
        again.bind(f"tcp://*:{taken - 1}")  # rank 0's port is free again
        assert not blocker.closed
    finally:
        ctx.destroy(linger=0)


def _taken_port_after_a_free_one(ctx: zmq.Context[Any]) -> tuple[zmq.Socket[Any], int]:
    """A socket of ``ctx`` and the port it holds, whose predecessor is free."""
    for _ in range(20):
        blocker = ctx.socket(zmq.PUB)
        taken = blocker.bind_to_random_port("tcp://127.0.0.1")
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", taken - 1))
            except OSError:
                blocker.close(linger=0)
                continue
        return blocker, taken
    raise RuntimeError("no bound port with a free one before it")
