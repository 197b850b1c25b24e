"""Setting the KV tiers up (docs/kv-tiers.md): the host tier (with the disk tier under it)
attached to the KV cache manager's pool. Every configuration takes them: tensor parallelism
moves each rank's shard, and a draft model (``draft_model`` speculation) needs nothing
moved: its KV in a block a tier brings back is never read before the draft rewrites it
(``worker/spec/draft_model.py``: every new or resumed request's draft catches up from
position 0)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenwire.runtime.core.disk_tier import DiskTier
from tokenwire.runtime.core.kv_cache_manager import KVCacheManager
from tokenwire.runtime.core.kv_connector import OffloadingConnector
from tokenwire.runtime.core.tier_index import EvictionPolicy


def attach_offloading(
    kv: KVCacheManager,
    num_slots: int,
    block_bytes: int,
    disk_slots: int = 0,
    disk_entries: Sequence[tuple[bytes, int]] = (),
    session_fraction: float = 1.0,
    eviction_policy: EvictionPolicy = "lru",
) -> OffloadingConnector:
    """The host tier (and the disk tier under it, seeded with the records a warm restart
    found) over ``kv``'s pool, its two hooks set (evictions, invariant refs). Both tiers
    evict by ``eviction_policy`` (``core/tier_index.py``)."""
    events = kv.block_pool.events
    disk = DiskTier(disk_slots, disk_entries, events, eviction_policy) if disk_slots else None
    connector = OffloadingConnector(
        kv.block_pool,
        num_slots,
        block_bytes,
        disk=disk,
        session_fraction=session_fraction,
        eviction_policy=eviction_policy,
    )
    kv.block_pool.on_evict = connector.on_evict
    kv.external_refs = connector.block_refs
    if kv.kv_events is not None:
        connector.announce = kv.record_stored
    return connector
