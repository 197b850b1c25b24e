"""``VllmEngine.SubscribeKvEvents`` and ``FlushCache`` end to end (issue 28): a real gRPC server
with ``--worker-protocol vllm`` and KV events on, the gateway's view through smg-grpc-proto's
stubs. A subscriber sees the snapshot, then the blocks a Generate cached (token ids, chained
parents, block size), each batch with the engine's load record; a late subscriber's snapshot
holds the same blocks; FlushCache resets the prefix cache and the stream says so."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from server_harness import ServerHarness
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from tokenwire.runtime.kv_events_config import KVEventsConfig

BLOCK = 16
PROMPT = list(range(40, 80))  # 40 tokens: two full blocks


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return dict(worker_protocol="vllm", kv_events=events)


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


class Subscriber:
    """Reads one SubscribeKvEvents stream on a thread; ``wait`` blocks on a predicate."""

    def __init__(self, stub: Any, start: int = 0) -> None:
        self.call = stub.SubscribeKvEvents(
            common_pb2.SubscribeKvEventsRequest(start_sequence_number=start)
        )
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

    def wait(self, done: Any, timeout: float = 30.0) -> list[common_pb2.KvEventBatch]:
        with self.changed:
            assert self.changed.wait_for(lambda: done(self.batches), timeout), self.batches
            return list(self.batches)

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def subscriber(stub: Any) -> Iterator[Subscriber]:
    s = Subscriber(stub)
    yield s
    s.close()


def stored(batches: list[common_pb2.KvEventBatch]) -> list[common_pb2.KvBlocksStored]:
    return [e.stored for b in batches for e in b.events if e.WhichOneof("data") == "stored"]


def test_subscriber_sees_the_blocks_a_generate_cached(
    stub: Any, subscriber: Subscriber, harness: ServerHarness
) -> None:
    first = subscriber.wait(lambda bs: len(bs) >= 1)[0]
    assert first.HasField("snapshot") and first.HasField("load")
    request = vllm_engine_pb2.GenerateRequest(
        request_id="kv-1",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=PROMPT),
        sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=2),
    )
    assert list(stub.Generate(request))[-1].HasField("complete")
    batches = subscriber.wait(
        lambda bs: sum(len(s.blocks) for s in stored(bs[1:])) >= len(PROMPT) // BLOCK
    )
    blocks = [b for s in stored(batches[1:]) for b in s.blocks]
    assert [list(b.token_ids) for b in blocks[:2]] == [PROMPT[:BLOCK], PROMPT[BLOCK : 2 * BLOCK]]
    assert all(b.block_size == BLOCK for b in blocks)
    assert len({b.block_hash for b in blocks}) == len(blocks)  # distinct chained hashes
    runs = stored(batches[1:])
    for run in runs[1:]:  # a later run continues the chain from a block already stored
        assert run.parent_block_hash in {b.block_hash for b in blocks}
    seqs = [b.sequence_number for b in batches[1:]]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all(b.HasField("load") for b in batches)
    late = Subscriber(stub)  # joins after the fact: the snapshot carries the same blocks
    try:
        (snap,) = late.wait(lambda bs: len(bs) >= 1)[:1]
        assert snap.HasField("snapshot") and snap.snapshot.blocks >= 2
        snapped = {b.block_hash for s in stored([snap]) for b in s.blocks}
        assert {b.block_hash for b in blocks[:2]} <= snapped
    finally:
        late.close()
    harness.assert_idle()


def test_flush_cache_resets_and_the_stream_says_so(
    stub: Any, subscriber: Subscriber, harness: ServerHarness
) -> None:
    subscriber.wait(lambda bs: len(bs) >= 1)
    flushed = stub.FlushCache(common_pb2.FlushCacheRequest())
    assert flushed.success, flushed.message
    subscriber.wait(lambda bs: any(e.WhichOneof("data") == "cleared" for b in bs for e in b.events))
    # Nothing cached any more: a new subscriber's snapshot is empty.
    late = Subscriber(stub)
    try:
        (snap,) = late.wait(lambda bs: len(bs) >= 1)[:1]
        assert snap.snapshot.blocks == 0 and not stored([snap])
    finally:
        late.close()
    harness.assert_idle()
