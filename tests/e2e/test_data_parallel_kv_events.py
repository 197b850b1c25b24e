"""KV events of a ``--data-parallel-size 2`` server (two engine-core processes), as a vLLM
router sees them: each rank publishes on its own ZMQ endpoints (the configured port plus the
rank, as vLLM does), every batch stamped with its ``data_parallel_rank`` and numbered 1, 2, ...
per rank. Requests pinned to a rank store their blocks on that rank's stream only; a replay on
a rank's replay endpoint returns that rank's batches; a prefix-cache reset clears both ranks'
sets; the engine ends idle. The gRPC ``SubscribeKvEvents`` stream merges both ranks: one
numbering across them, each batch stamped with its rank, one snapshot chunk per rank."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import zmq
from kv_subscriber import Subscriber
from server_harness import ServerHarness
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from vllm_kv_schema import BlockStored

from tokenwire.runtime.front.kv_events_front import KVEventsFront
from tokenwire.runtime.front.request_stream import RequestFinished
from tokenwire.runtime.kv_events_config import KVEventsConfig
from tokenwire.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
RANKS = (0, 1)
PROMPTS = {0: list(range(100, 140)), 1: list(range(200, 240))}  # 40 tokens: 2 full blocks each


def free_port_pair() -> int:
    """A port P with P and P + 1 both free now (rank r binds P + r)."""
    for _ in range(50):
        with ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            second = stack.enter_context(socket.socket())
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


@dataclass
class Served:
    harness: ServerHarness
    front: KVEventsFront
    subs: dict[int, Subscriber]  # by rank, on that rank's endpoints
    ports: tuple[int, int]  # the configured PUB and replay ports (rank 0's)


@pytest.fixture(scope="module")
def served(tiny_model_factory: Callable[..., Path]) -> Iterator[Served]:
    pub, replay = free_port_pair(), free_port_pair()
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{pub}",  # a wildcard is bound, as in vLLM
        replay_endpoint=f"tcp://127.0.0.1:{replay}",
        topic="kv",
    )
    harness = ServerHarness(
        tiny_model_factory("llama"), data_parallel_size=2, kv_events=events, worker_protocol="vllm"
    ).start()
    front = harness.engine._kv_events
    assert front is not None
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        subs = {
            r: Subscriber(ctx, f"tcp://127.0.0.1:{pub + r}", f"tcp://127.0.0.1:{replay + r}")
            for r in RANKS
        }
        yield Served(harness, front, subs, (pub, replay))
    finally:
        ctx.destroy(linger=0)
        harness.stop()


def run(harness: ServerHarness, rank: int, request_id: str) -> None:
    async def go() -> None:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        stream = harness.engine.add_request(
            request_id, None, PROMPTS[rank], params, data_parallel_rank=rank
        )
        finished = [item async for item in stream if isinstance(item, RequestFinished)]
        assert finished, f"{request_id} did not finish"

    harness.run(go())


def caught_up(served: Served, rank: int) -> Subscriber:
    """The rank's subscriber once it holds every batch its hub numbered (live, then replay)."""
    sub, hub = served.subs[rank], served.front.hubs[rank]
    deadline = time.monotonic() + 30
    while max(sub.batches, default=0) < hub.last_seq:
        assert time.monotonic() < deadline, f"rank {rank} never caught up to {hub.last_seq}"
        sub.drain()
        sub.replay_from(1)
    return sub


def stored_tokens(sub: Subscriber) -> list[list[int]]:
    return [
        e.token_ids for b in sub.batches.values() for e in b.events if isinstance(e, BlockStored)
    ]


def test_each_rank_publishes_its_own_blocks_on_its_own_port(served: Served) -> None:
    pub, replay = served.ports
    for rank, publisher in zip(RANKS, served.front.publishers, strict=True):
        assert publisher.endpoint.endswith(f":{pub + rank}")
        assert publisher.replay_endpoint == f"tcp://127.0.0.1:{replay + rank}"
    for rank in RANKS:
        run(served.harness, rank, f"pinned-{rank}")
    for rank in RANKS:
        sub = caught_up(served, rank)
        assert {b.data_parallel_rank for b in sub.batches.values()} == {rank}
        tokens = stored_tokens(sub)
        assert PROMPTS[rank][:32] in [t[:32] for t in tokens], tokens  # its prompt's blocks
        other = PROMPTS[1 - rank][:16]
        assert all(t[:16] != other for t in tokens), "the other rank's blocks leaked in"
        assert sub.blocks() == served.front.hubs[rank].cached_block_hashes  # 1, 2, ... no gap
    served.harness.assert_idle()


def test_a_replay_answers_from_its_rank_only(served: Served) -> None:
    for rank in RANKS:
        run(served.harness, rank, f"again-{rank}")  # a prefix hit: maybe no new batch
    run(served.harness, 1, "rank1-more")
    for rank in RANKS:
        sub = caught_up(served, rank)
        live = dict(sub.batches)
        sub.batches.clear()
        replayed = sub.replay_from(1)
        assert replayed == list(range(1, served.front.hubs[rank].last_seq + 1))
        assert sub.batches == live  # the same batches, byte for byte decoded the same
        last = replayed[-1]
        assert sub.replay_from(last) == [last]
        assert sub.batches[last].data_parallel_rank == rank
    served.harness.assert_idle()


def test_a_cache_reset_clears_every_rank_and_leaves_the_engine_idle(served: Served) -> None:
    for rank in RANKS:
        run(served.harness, rank, f"before-reset-{rank}")
    assert served.harness.run(served.harness.engine.reset_prefix_cache())
    for rank in RANKS:
        sub = caught_up(served, rank)
        last = sub.batches[max(sub.batches)]
        assert [type(e).__name__ for e in last.events][-1] == "AllBlocksCleared"
        assert sub.blocks() == set() == served.front.hubs[rank].cached_block_hashes
    served.harness.assert_idle()
    report = served.harness.kv_report()
    assert report.num_free_blocks == report.num_blocks


class GrpcStream:
    """One ``SubscribeKvEvents`` call read on a thread; ``wait`` blocks on a predicate."""

    def __init__(self, channel: grpc.Channel, start: int = 0) -> None:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        request = common_pb2.SubscribeKvEventsRequest(start_sequence_number=start)
        self.call = stub.SubscribeKvEvents(request)
        self.batches: list[common_pb2.KvEventBatch] = []
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                with self.changed:
                    self.batches.append(batch)
                    self.changed.notify_all()
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.CANCELLED, err

    def wait(self, done: Callable[[list[Any]], bool]) -> list[common_pb2.KvEventBatch]:
        with self.changed:
            assert self.changed.wait_for(lambda: done(self.batches), 30), self.batches
            return list(self.batches)

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(10)


def grpc_blocks(batches: list[common_pb2.KvEventBatch]) -> dict[int, set[int]]:
    """Each rank's block set (signed hashes) rebuilt from a stream, snapshot chunks included."""
    sets: dict[int, set[int]] = {r: set() for r in RANKS}
    for batch in batches:
        blocks = sets[batch.dp_rank]
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                blocks.update(b.block_hash for b in event.stored.blocks)
            elif kind == "removed":
                blocks.difference_update(event.removed.block_hashes)
            else:
                blocks.clear()
    return sets


def signed(hashes: set[int]) -> set[int]:
    return {h - (1 << 64) if h >= (1 << 63) else h for h in hashes}


def test_the_grpc_stream_merges_every_rank(served: Served) -> None:
    """One SubscribeKvEvents stream carries both cores' batches: a snapshot chunk per rank,
    then live batches numbered 1, 2, ... across the ranks (every batch either hub numbered),
    each stamped with its rank and carrying that rank's blocks only; a replay from N returns
    the same batches from N on; the rebuilt per-rank sets equal the hubs'."""
    harness, front = served.harness, served.front
    merged = front.merged
    assert merged is not None and harness.engine.kv_events is merged
    with harness.channel() as channel:
        stream = GrpcStream(channel)
        first = stream.wait(lambda b: len(b) >= 2)[:2]
        assert [(b.snapshot.index, b.snapshot.count, b.dp_rank) for b in first] == [
            (0, 2, 0), (1, 2, 1)
        ]  # fmt: skip
        start = first[0].sequence_number
        assert first[1].sequence_number == start == merged.last_seq
        for rank in RANKS:
            run(harness, rank, f"grpc-{rank}")
        harness.assert_idle()  # no batch is on its way any more
        end = front.hubs[0].last_seq + front.hubs[1].last_seq
        assert merged.last_seq == end  # every batch of either rank, numbered once
        batches = stream.wait(lambda b: b[-1].sequence_number >= end)
        stream.close()
        live = batches[2:]
        assert [b.sequence_number for b in live] == list(range(start + 1, end + 1))
        for batch in live:
            tokens = [list(b.token_ids) for e in batch.events for b in e.stored.blocks]
            other = PROMPTS[1 - batch.dp_rank][:16]
            assert all(t != other for t in tokens), "a batch carries the other rank's blocks"
        sets = grpc_blocks(batches)
        for rank in RANKS:
            assert sets[rank] == signed(front.hubs[rank].cached_block_hashes)
            assert any(
                list(b.token_ids) == PROMPTS[rank][:16]
                for x in live
                if x.dp_rank == rank
                for e in x.events
                for b in e.stored.blocks
            )
        replay = GrpcStream(channel, start + 1)
        again = replay.wait(lambda b: len(b) >= len(live))
        replay.close()
        assert [without_load(b) for b in again] == [without_load(b) for b in live]


def without_load(batch: common_pb2.KvEventBatch) -> bytes:
    copy = common_pb2.KvEventBatch()
    copy.CopyFrom(batch)
    copy.ClearField("load")
    return copy.SerializeToString(deterministic=True)


def test_a_null_publisher_serves_the_merged_grpc_stream(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """``"publisher": "null"`` with two cores: no ZMQ socket, the gRPC stream alone."""
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    harness = ServerHarness(
        tiny_model_factory("llama"), data_parallel_size=2, kv_events=events, worker_protocol="vllm"
    ).start()
    try:
        front = harness.engine._kv_events
        assert front is not None and not front.publishers and front.merged is not None
        with harness.channel() as channel:
            stream = GrpcStream(channel)
            run(harness, 1, "null-1")
            batches = stream.wait(lambda b: any(x.dp_rank == 1 and not x.snapshot.count for x in b))
            stream.close()
        sets = grpc_blocks(batches)
        assert sets[1] and not sets[0]
        harness.assert_idle()
    finally:
        harness.stop()
