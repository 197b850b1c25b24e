"""The hub's KV-event batches as ``smg.grpc.common.KvEventBatch`` (what ``SubscribeKvEvents``
streams): live batches in order with their sequence numbers, a late subscriber's snapshot
chunk, the int64 form of the 64-bit hashes, extra keys / cache salt / LoRA, the load record.
The events come from a real ``KVCacheManager`` driven through allocate / free / evict."""

from __future__ import annotations

import asyncio

from smg_grpc_proto.generated import common_pb2

from tokenwire.runtime.core.kv_cache_manager import KVCacheManager
from tokenwire.runtime.core.kv_events import KVEventBatch, KVEventRecorder
from tokenwire.runtime.core.request import Request
from tokenwire.runtime.engine.protocol import EngineStatsSnapshot
from tokenwire.runtime.front.kv_event_hub import KVEventHub
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.server.worker_protocol.kv_events import batch_to_proto, engine_load, signed_int64


def _request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), frozenset(), 128, cache_salt=salt)


def _step(hub: KVEventHub, recorder: KVEventRecorder) -> None:
    hub.publish(KVEventBatch(ts=1.0, events=recorder.take()))


def test_batches_and_snapshot_convert_to_smg_proto() -> None:
    recorder = KVEventRecorder(4)
    kv = KVCacheManager(6, 4, True, kv_events=recorder)  # 5 usable blocks
    hub = KVEventHub(4, buffer_steps=8)

    async def run() -> None:
        live = hub.subscribe(0)
        first = await anext(live)  # an empty snapshot: nothing cached yet
        assert first.snapshot and first.seq == 0
        a = _request("a", list(range(1, 14)), salt="tenant:x")  # 3 full blocks
        assert kv.allocate_slots(a, 13) is not None
        _step(hub, recorder)
        kv.free(a)
        b = _request("b", list(range(50, 70)))  # 5 blocks: evicts a's
        assert kv.allocate_slots(b, 20) is not None
        _step(hub, recorder)
        stored = batch_to_proto(await anext(live))
        assert stored.sequence_number == 1 and stored.dp_rank == 0
        (event,) = stored.events
        assert event.WhichOneof("data") == "stored" and event.event_id == 1 << 20
        assert event.stored.cache_salt == "tenant:x" and not event.stored.HasField(
            "parent_block_hash"
        )
        assert [list(blk.token_ids) for blk in event.stored.blocks] == [
            [1, 2, 3, 4],
            [5, 6, 7, 8],
            [9, 10, 11, 12],
        ]
        assert event.stored.blocks[0].extra_keys[0].text == "salt:tenant:x"
        assert event.stored.tier == common_pb2.KV_CACHE_TIER_DEVICE
        second = batch_to_proto(await anext(live))
        kinds = [e.WhichOneof("data") for e in second.events]
        assert "removed" in kinds and "stored" in kinds
        removed = next(e.removed for e in second.events if e.HasField("removed"))
        assert set(removed.block_hashes) == {b.block_hash for b in event.stored.blocks}
        await live.aclose()
        # A late subscriber: one snapshot chunk with b's five blocks, as of sequence 2.
        late = hub.subscribe(0)
        snap = batch_to_proto(
            await anext(late), engine_load(EngineStatsSnapshot(num_running=3), 8, 1)
        )
        await late.aclose()
        assert snap.sequence_number == 2 and snap.snapshot.count == 1 and snap.snapshot.blocks == 5
        assert snap.events[0].WhichOneof("data") == "cleared"
        assert snap.load.running_requests == 3 and snap.load.max_running_requests == 8
        common_pb2.KvEventBatch.FromString(snap.SerializeToString())  # a valid message

    asyncio.run(run())


def test_hashes_become_int64() -> None:
    assert signed_int64(2**64 - 1) == -1
    assert signed_int64(2**63) == -(2**63)
    assert signed_int64(12345) == 12345


def test_replay_from_a_sequence_number_and_lagging() -> None:
    hub = KVEventHub(4, buffer_steps=3)
    for _ in range(5):
        hub.publish(KVEventBatch(ts=0.0, events=[]))

    async def run() -> None:
        replay = hub.subscribe(4)
        assert [(await anext(replay)).seq for _ in range(2)] == [4, 5]
        await replay.aclose()
        too_old = hub.subscribe(1)  # older than the buffer: the snapshot instead
        assert (await anext(too_old)).snapshot
        await too_old.aclose()

    asyncio.run(run())
