"""``MergedKVEvents``: several data-parallel ranks' KV-event hubs as one numbered stream (the
gRPC ``SubscribeKvEvents`` of a ``--data-parallel-size N`` server). Real hubs, no engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tokenwire.runtime.core.kv_events import BlockRemoved, BlockStored, KVEventBatch
from tokenwire.runtime.front.kv_event_hub import KVEventHub, SequencedBatch, SubscriberLagged
from tokenwire.runtime.front.kv_event_merge import MergedKVEvents
from tokenwire.server.worker_protocol.kv_events import batch_to_proto

BLOCK = 4


def stored(h: int, parent: int | None = None) -> KVEventBatch:
    event = BlockStored([h], parent, [h % 100] * BLOCK, BLOCK, None, None, None)
    return KVEventBatch(ts=1.0, events=[event])


def removed(h: int) -> KVEventBatch:
    return KVEventBatch(ts=2.0, events=[BlockRemoved([h], None)])


def make(buffer_steps: int = 8) -> tuple[list[KVEventHub], MergedKVEvents]:
    hubs = [KVEventHub(BLOCK, buffer_steps, rank) for rank in (0, 1)]
    return hubs, MergedKVEvents(hubs, buffer_steps)


async def take(stream: AsyncIterator[SequencedBatch], n: int) -> list[SequencedBatch]:
    return [await asyncio.wait_for(anext(stream), 5) for _ in range(n)]


def test_batches_of_every_rank_get_one_numbering_and_their_rank() -> None:
    async def go() -> None:
        hubs, merged = make()
        live = merged.subscribe(0)
        first = await take(live, 2)  # an empty snapshot chunk per rank
        assert [(i.snapshot, i.chunk, i.chunks, i.seq) for i in first] == [
            (True, 0, 2, 0), (True, 1, 2, 0)
        ]  # fmt: skip
        hubs[1].publish(stored(11))
        hubs[0].publish(stored(10))
        hubs[1].publish(stored(12, parent=11))
        hubs[1].publish(removed(11))
        items = await take(live, 4)
        assert [(i.seq, i.batch.data_parallel_rank) for i in items] == [
            (1, 1), (2, 0), (3, 1), (4, 1)
        ]  # fmt: skip
        assert (hubs[0].last_seq, hubs[1].last_seq, merged.last_seq) == (1, 3, 4)
        await live.aclose()
        # A replay from 3 returns the merged batches 3 and 4; a snapshot has each rank's set.
        assert [i.seq for i in await take(merged.subscribe(3), 2)] == [3, 4]
        chunks = await take(merged.subscribe(0), 2)
        sets = [
            {h for e in c.batch.events if isinstance(e, BlockStored) for h in e.block_hashes}
            for c in chunks
        ]
        assert sets == [{10}, {12}] and all(c.seq == 4 for c in chunks)
        # On the wire: one chunk per rank, dp_rank stamped, event ids distinct across chunks.
        protos = [batch_to_proto(c) for c in chunks]
        assert [(p.dp_rank, p.snapshot.index, p.snapshot.count) for p in protos] == [
            (0, 0, 2), (1, 1, 2)
        ]  # fmt: skip
        ids = [e.event_id for p in protos for e in p.events]
        assert len(ids) == len(set(ids))

    asyncio.run(go())


def test_an_old_start_gets_a_snapshot_and_a_slow_subscriber_is_ended() -> None:
    async def go() -> None:
        hubs, merged = make(buffer_steps=3)
        for h in range(5):
            hubs[h % 2].publish(stored(20 + h))
        # Batch 1 left the 3-batch buffer: a snapshot (one chunk per rank) comes first.
        items = await take(merged.subscribe(1), 2)
        assert all(i.snapshot and i.seq == 5 for i in items)
        slow = merged.subscribe(5)
        assert [i.seq for i in await take(slow, 1)] == [5]
        for h in range(4):
            hubs[0].publish(stored(40 + h))
        with pytest.raises(SubscriberLagged):
            await take(slow, 4)
        with pytest.raises(ValueError, match="start_sequence_number"):
            await take(merged.subscribe(-1), 1)

    asyncio.run(go())
