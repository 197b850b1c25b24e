"""``KVEventHub``: the front's copy of the core's KV-cache event stream, for subscribers.

Each ``StepResult`` that carries KV events becomes one batch with the next sequence number
(1, 2, ...: the numbers the ZMQ publisher sends too). The hub keeps the last
``buffer_steps`` batches for replay, the set of blocks now cached (rebuilt from the events,
so a late subscriber can start from a snapshot) and one queue per live subscriber. It runs on
the front's event loop; the engine core only ever hands over its per-step list.

``subscribe(start)``: 0 = a snapshot of the cached blocks (stamped with the last sequence
number) then live batches; N > 0 = the buffered batches from N on, then live (a snapshot
first when N is older than the buffer). A subscriber that falls ``buffer_steps`` batches
behind is ended with ``SubscriberLagged`` (it can resubscribe from its last number).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from tokenwire.runtime.core.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    AnyKVEvent,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "KVEventHub",
    "KVEventStream",
    "SequencedBatch",
    "SubscriberLagged",
]


class SubscriberLagged(RuntimeError):
    """The subscriber fell a whole replay buffer behind."""


@dataclass(frozen=True, slots=True)
class SequencedBatch:
    seq: int
    batch: KVEventBatch
    snapshot: bool = False  # the cached-block set as of ``seq``, not a batch the core sent
    # A snapshot in several chunks (one per data-parallel rank, ``kv_event_merge``): this
    # one's index and their count, and the index its first event has among all the chunks'.
    chunk: int = 0
    chunks: int = 1
    first_event: int = 0


class KVEventStream(Protocol):
    """A numbered stream of batches a subscriber can start from a snapshot or a number: one
    core's ``KVEventHub``, or several cores' ``MergedKVEvents``."""

    @property
    def last_seq(self) -> int: ...

    def subscribe(self, start_sequence_number: int = 0) -> AsyncIterator[SequencedBatch]: ...


@dataclass(frozen=True, slots=True)
class _CachedBlock:
    parent: int | None
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    extra: tuple[object, ...] | None
    medium: str | None


Sink = Callable[[int, KVEventBatch], None]


class KVEventHub:
    def __init__(self, block_size: int, buffer_steps: int, data_parallel_rank: int = 0) -> None:
        self.block_size = block_size
        self.buffer_steps = buffer_steps
        self.data_parallel_rank = data_parallel_rank
        self.last_seq = 0
        self._buffer: deque[SequencedBatch] = deque(maxlen=buffer_steps)
        # By (hash, medium): a block may live on the device and in a KV tier at once.
        self._blocks: dict[tuple[int, str | None], _CachedBlock] = {}
        self._queues: set[asyncio.Queue[SequencedBatch | None]] = set()
        self._sinks: list[Sink] = []

    def add_sink(self, sink: Sink) -> None:
        """``sink(seq, batch)`` sees every batch (the ZMQ publisher queues it; never blocks)."""
        self._sinks.append(sink)

    @property
    def cached_block_hashes(self) -> set[int]:
        """The blocks cached on the device (the KV tiers' are ``tier_block_hashes``)."""
        return {h for h, medium in self._blocks if medium in (MEDIUM_GPU, None)}

    def tier_block_hashes(self, medium: str) -> set[int]:
        return {h for h, m in self._blocks if m == medium}

    def publish(self, batch: KVEventBatch) -> None:
        """Number one core batch, apply it to the block set and hand it to everyone."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        self.last_seq += 1
        item = SequencedBatch(self.last_seq, batch)
        for event in batch.events:
            self._apply(event)
        self._buffer.append(item)
        for sink in self._sinks:
            sink(item.seq, batch)
        for queue in list(self._queues):
            if queue.qsize() >= self.buffer_steps:
                self._queues.discard(queue)
                queue.put_nowait(None)  # lagged: its iterator raises
            else:
                queue.put_nowait(item)

    def _apply(self, event: AnyKVEvent) -> None:
        blocks = self._blocks
        if isinstance(event, BlockStored):
            parent, bs = event.parent_block_hash, event.block_size
            for i, h in enumerate(event.block_hashes):
                extra = None if event.extra_keys is None else event.extra_keys[i]
                tokens = event.token_ids[i * bs : (i + 1) * bs]
                blocks[h, event.medium] = _CachedBlock(
                    parent, tokens, event.lora_id, event.lora_name, extra, event.medium
                )
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                blocks.pop((h, event.medium), None)
        else:
            blocks.clear()

    def snapshot(self) -> SequencedBatch:
        """The cached blocks as ``BlockStored`` events, parents before children."""
        events: list[AnyKVEvent] = [AllBlocksCleared()]
        done: set[tuple[int, str | None]] = set()
        for key in self._blocks:
            self._emit(key, done, events)
        batch = KVEventBatch(ts=0.0, events=events, data_parallel_rank=self.data_parallel_rank)
        return SequencedBatch(self.last_seq, batch, snapshot=True)

    def _emit(
        self,
        key: tuple[int, str | None],
        done: set[tuple[int, str | None]],
        events: list[AnyKVEvent],
    ) -> None:
        chain: list[tuple[int, str | None]] = []
        while key not in done and key in self._blocks:  # up to a block already emitted
            chain.append(key)
            done.add(key)
            parent = self._blocks[key].parent
            if parent is None:
                break
            key = (parent, key[1])  # a chain stays in its tier
        for key in reversed(chain):
            b = self._blocks[key]
            events.append(
                BlockStored(
                    [key[0]],
                    b.parent,
                    b.token_ids,
                    self.block_size,
                    b.lora_id,
                    b.medium,
                    b.lora_name,
                    None if b.extra is None else [b.extra],
                )
            )

    async def subscribe(self, start_sequence_number: int = 0) -> AsyncIterator[SequencedBatch]:
        """Replay or snapshot, then live batches until the consumer stops iterating."""
        async for item in serve_subscriber(
            self._queues, self._backlog, start_sequence_number, self.buffer_steps
        ):
            yield item

    def _backlog(self, start: int) -> list[SequencedBatch]:
        oldest = self._buffer[0].seq if self._buffer else self.last_seq + 1
        if start == 0 or start < oldest:
            return [self.snapshot()]  # from the current state (older batches are gone)
        return [item for item in self._buffer if item.seq >= start]


async def serve_subscriber(
    queues: set[asyncio.Queue[SequencedBatch | None]],
    backlog: Callable[[int], list[SequencedBatch]],
    start: int,
    buffer_steps: int,
) -> AsyncIterator[SequencedBatch]:
    """One subscriber of a hub (or of the data-parallel merge): its queue joins ``queues``
    before ``backlog(start)`` is read, so no batch falls between the two; then live batches,
    until it lags (``None`` in its queue) or the consumer stops iterating."""
    if start < 0:
        raise ValueError(f"start_sequence_number must be >= 0, got {start}")
    queue: asyncio.Queue[SequencedBatch | None] = asyncio.Queue()
    queues.add(queue)
    try:
        for item in backlog(start):
            yield item
        while True:
            live = await queue.get()
            if live is None:
                raise SubscriberLagged(
                    f"subscriber fell {buffer_steps} batches behind; resubscribe"
                )
            yield live
    finally:
        queues.discard(queue)
