"""KV-cache events in vLLM's schema (``vllm/distributed/kv_events.py``), recorded by the block
pool and the KV cache manager while a step runs and shipped with the step's ``StepResult``.

The records are msgspec Structs shaped exactly as vLLM's (``array_like``, ``omit_defaults``,
``tag=True``: a BlockStored encodes as ``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name, extra_keys...]``), so a subscriber that
decodes vLLM's ``KVEventBatch`` decodes tokenwire's unchanged. Block hashes on the wire are
``external_block_hash``: the low 64 bits of the 32-byte sha256 chain hash, as vLLM's
``maybe_convert_block_hash`` does with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (its default).

Recording is off unless ``--kv-events-config`` enables it: the pool and manager hold
``None`` then and pay one attribute test per eviction / cached block run.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # vLLM's name for the device tier, whatever the device
MEDIUM_CPU = "CPU"  # the host tier (vLLM's offloading connector names its CPU tier so)
MEDIUM_DISK = "DISK"  # the disk tier under it


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three event kinds (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # One entry per block: the pieces (UTF-8 text) whose concatenation is the block's extra
    # bytes in the hash; None for a block without extra keys (every block after the first).
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


AnyKVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[AnyKVEvent]


def external_block_hash(block_hash: bytes) -> int:
    """The event form of a chain hash: its last 8 bytes as a big-endian unsigned int
    (``int.from_bytes(h, "big") & (2**64 - 1)``, vLLM's conversion)."""
    return int.from_bytes(block_hash[-8:], "big")


class KVEventRecorder:
    """Events of the step in progress, in the order they happened; ``take`` hands them over.

    Consecutive removals merge into one ``BlockRemoved``; each run of blocks one request
    caches in one call is one ``BlockStored`` (vLLM's granularity)."""

    __slots__ = ("_events", "block_size")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[AnyKVEvent] = []

    def stored(
        self,
        hashes: list[bytes],
        parent: bytes | None,
        token_ids: list[int],
        lora: tuple[int, str] | None,
        extras: list[tuple[Any, ...] | None],
    ) -> None:
        """``extras``: each block's extra-key pieces (None for a block without any)."""
        extra = extras if any(e is not None for e in extras) else None
        self._events.append(
            BlockStored(
                block_hashes=[external_block_hash(h) for h in hashes],
                parent_block_hash=None if parent is None else external_block_hash(parent),
                token_ids=token_ids,
                block_size=self.block_size,
                lora_id=None if lora is None else lora[0],
                medium=MEDIUM_GPU,
                lora_name=None if lora is None else lora[1],
                extra_keys=extra,
            )
        )

    def tier_stored(self, block_hash: bytes, medium: str) -> None:
        """A KV tier under the device took ``block_hash`` (vLLM's offloading connector form:
        no tokens, no parent; the device's own event named them). Consecutive stores to one
        tier merge."""
        events = self._events
        last = events[-1] if events else None
        if isinstance(last, BlockStored) and last.medium == medium and not last.token_ids:
            last.block_hashes.append(external_block_hash(block_hash))
            return
        events.append(
            BlockStored([external_block_hash(block_hash)], None, [], self.block_size, None,
                        medium, None)
        )  # fmt: skip

    def removed(self, block_hash: bytes, medium: str = MEDIUM_GPU) -> None:
        events = self._events
        last = events[-1] if events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(external_block_hash(block_hash))
        else:
            events.append(BlockRemoved([external_block_hash(block_hash)], medium))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[AnyKVEvent]:
        events, self._events = self._events, []
        return events
