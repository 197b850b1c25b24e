"""``MergedKVEvents``: the KV-cache events of several engine cores (``--data-parallel-size``)
as one stream, for the gRPC ``SubscribeKvEvents`` call.

Each rank keeps its own ``KVEventHub`` (its block set, its ZMQ sequence numbers 1, 2, ...
and replay buffer); the merge sees every batch a hub numbers, in the order the front received
them, and gives it the next number of its own (1, 2, ... across every rank), its rank stamped
on it (``data_parallel_rank``). So one subscriber, one numbering, and each batch says whose
blocks it changes: a consumer keeps one block set per rank, as it would per ZMQ endpoint.

``subscribe(start)``, as a hub's: 0 = a snapshot then live batches; N > 0 = the merge's
buffered batches from N on (the last ``buffer_steps`` across all ranks), then live, or a
snapshot first when N is older than that buffer. The snapshot is one chunk per rank (rank
``r``'s cached blocks, chunk ``r`` of ``N``, each first clearing that rank's view), all
stamped with the merge's last number. A subscriber that falls ``buffer_steps`` batches
behind is ended with ``SubscriberLagged``. The merge's numbers are not the ZMQ numbers of the
same batches (those are per rank).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import AsyncIterator, Sequence

from tokenwire.runtime.core.kv_events import KVEventBatch
from tokenwire.runtime.front.kv_event_hub import KVEventHub, SequencedBatch, serve_subscriber


class MergedKVEvents:
    """Runs on the front's event loop, like the hubs it listens to."""

    def __init__(self, hubs: Sequence[KVEventHub], buffer_steps: int) -> None:
        self.hubs = list(hubs)
        self.buffer_steps = buffer_steps
        self.last_seq = 0
        self._buffer: deque[SequencedBatch] = deque(maxlen=buffer_steps)
        self._queues: set[asyncio.Queue[SequencedBatch | None]] = set()
        for hub in self.hubs:
            hub.add_sink(self._on_batch)

    def _on_batch(self, rank_seq: int, batch: KVEventBatch) -> None:
        """A hub numbered ``batch`` (its rank is stamped already): number it again here."""
        self.last_seq += 1
        item = SequencedBatch(self.last_seq, batch)
        self._buffer.append(item)
        for queue in list(self._queues):
            if queue.qsize() >= self.buffer_steps:
                self._queues.discard(queue)
                queue.put_nowait(None)  # lagged: its iterator raises
            else:
                queue.put_nowait(item)

    def snapshot(self) -> list[SequencedBatch]:
        """Every rank's cached blocks, one chunk per rank, stamped with the last number; event
        ids run on across the chunks."""
        chunks = []
        first = 0
        for index, hub in enumerate(self.hubs):
            own = hub.snapshot()
            chunks.append(
                dataclasses.replace(
                    own, seq=self.last_seq, chunk=index, chunks=len(self.hubs), first_event=first
                )
            )
            first += len(own.batch.events)
        return chunks

    async def subscribe(self, start_sequence_number: int = 0) -> AsyncIterator[SequencedBatch]:
        """Replay or snapshot, then live batches until the consumer stops iterating."""
        async for item in serve_subscriber(
            self._queues, self._backlog, start_sequence_number, self.buffer_steps
        ):
            yield item

    def _backlog(self, start: int) -> list[SequencedBatch]:
        oldest = self._buffer[0].seq if self._buffer else self.last_seq + 1
        if start == 0 or start < oldest:
            return self.snapshot()  # from the current state (older batches are gone)
        return [item for item in self._buffer if item.seq >= start]
