"""KV-event batches of the front's ``KVEventHub`` as ``smg.grpc.common.KvEventBatch`` (the
``SubscribeKvEvents`` stream of the vLLM engine worker protocol, from ``smg-grpc-proto``).

Mapping (one ``KvCacheEvent`` per vLLM-schema event, in order):
- ``BlockStored`` -> ``KvBlocksStored``: one ``KvBlock`` per block (its ``block_size`` token
  ids, ``lora_id``, the extra-key pieces as ``KvBlockExtraKey.text``, an image's
  ``(identifier, offset)`` as ``KvBlockExtraKey.multimodal``), ``parent_block_hash``,
  ``tier`` DEVICE, ``medium`` "GPU", ``lora_name``, ``cache_salt`` (from the ``salt:`` piece).
- ``BlockRemoved`` -> ``KvBlocksRemoved``; ``AllBlocksCleared`` -> ``KvCacheCleared``.
- Hashes are the same 64-bit values as on ZMQ, reinterpreted as signed ``int64`` (two's
  complement): ``h - 2**64`` when ``h >= 2**63``.
- ``sequence_number`` is the hub's (the ZMQ sequence number of the same batch; with several
  data-parallel cores the merged stream's own, ``kv_event_merge``);
  ``event_id = sequence_number << 20 | index`` (monotonic per worker). A snapshot (a late
  subscriber's start) is one ``KvSnapshotChunk(index=0, count=1)`` stamped with the last
  sequence number, whose first event clears the subscriber's view; with several
  data-parallel cores one chunk per rank (``index`` r of ``count`` N, ``dp_rank`` r, its first
  event clearing that rank's view, event ids running on across the chunks).
- ``dp_rank``: the core whose blocks the batch changes (``data_parallel_rank``).
"""

from __future__ import annotations

from typing import Any

from smg_grpc_proto.generated import common_pb2

from tokenwire.runtime.engine.protocol import EngineStatsSnapshot
from tokenwire.runtime.front.kv_event_hub import (
    BlockRemoved,
    BlockStored,
    SequencedBatch,
)

_EVENT_ID_SHIFT = 20
SALT_PREFIX = "salt:"


def signed_int64(block_hash: int) -> int:
    """The ``int64`` wire form of an unsigned 64-bit block hash."""
    return block_hash - (1 << 64) if block_hash >= (1 << 63) else block_hash


def _extra_key(piece: Any) -> common_pb2.KvBlockExtraKey:
    """A text piece (salt, LoRA) as ``text``; an image's ``(identifier, offset)`` as
    ``multimodal``."""
    if isinstance(piece, (list, tuple)) and len(piece) == 2:
        identifier, offset = piece
        key = common_pb2.KvMultimodalKey(identifier=str(identifier), offset=int(offset))
        return common_pb2.KvBlockExtraKey(multimodal=key)
    return common_pb2.KvBlockExtraKey(text=str(piece))


def _stored(event: BlockStored) -> common_pb2.KvBlocksStored:
    bs = event.block_size
    blocks = []
    salt: str | None = None
    for i, h in enumerate(event.block_hashes):
        extra = None if event.extra_keys is None else event.extra_keys[i]
        keys = [_extra_key(p) for p in extra or ()]
        for piece in extra or ():
            if isinstance(piece, str) and piece.startswith(SALT_PREFIX):
                salt = piece[len(SALT_PREFIX) :]
        block = common_pb2.KvBlock(
            block_hash=signed_int64(h),
            token_ids=event.token_ids[i * bs : (i + 1) * bs],
            block_size=bs,
            extra_keys=keys,
        )
        if event.lora_id is not None:
            block.lora_id = event.lora_id
        blocks.append(block)
    stored = common_pb2.KvBlocksStored(blocks=blocks, tier=common_pb2.KV_CACHE_TIER_DEVICE)
    if event.parent_block_hash is not None:
        stored.parent_block_hash = signed_int64(event.parent_block_hash)
    if event.medium is not None:
        stored.medium = event.medium
    if event.lora_name is not None:
        stored.lora_name = event.lora_name
    if salt is not None:
        stored.cache_salt = salt
    return stored


def _event(event: Any, event_id: int) -> common_pb2.KvCacheEvent:
    if isinstance(event, BlockStored):
        return common_pb2.KvCacheEvent(event_id=event_id, stored=_stored(event))
    if isinstance(event, BlockRemoved):
        removed = common_pb2.KvBlocksRemoved(
            block_hashes=[signed_int64(h) for h in event.block_hashes],
            tier=common_pb2.KV_CACHE_TIER_DEVICE,
        )
        if event.medium is not None:
            removed.medium = event.medium
        return common_pb2.KvCacheEvent(event_id=event_id, removed=removed)
    return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())


def batch_to_proto(
    item: SequencedBatch, load: common_pb2.EngineLoad | None = None
) -> common_pb2.KvEventBatch:
    """One hub batch (or snapshot) as the proto the gateway subscribes to."""
    base = item.seq << _EVENT_ID_SHIFT | item.first_event
    out = common_pb2.KvEventBatch(
        sequence_number=item.seq,
        timestamp=item.batch.ts,
        events=[_event(e, base + i) for i, e in enumerate(item.batch.events)],
    )
    if item.batch.data_parallel_rank is not None:
        out.dp_rank = item.batch.data_parallel_rank
    if item.snapshot:
        num_blocks = sum(
            len(e.block_hashes) for e in item.batch.events if isinstance(e, BlockStored)
        )
        chunk = common_pb2.KvSnapshotChunk(index=item.chunk, count=item.chunks, blocks=num_blocks)
        out.snapshot.CopyFrom(chunk)
    if load is not None:
        out.load.CopyFrom(load)
    return out


def engine_load(
    stats: EngineStatsSnapshot, max_running_requests: int, sample: int, age_ms: int = 0
) -> common_pb2.EngineLoad:
    """The load record the proto attaches to a batch, from the engine's stats snapshot."""
    return common_pb2.EngineLoad(
        running_requests=stats.num_running,
        waiting_requests=stats.num_waiting,
        token_usage=stats.kv_cache_usage,
        max_running_requests=max_running_requests,
        age_ms=age_ms,
        sample=sample,
    )
