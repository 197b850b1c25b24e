"""The slot index of a KV tier (host or disk), by eviction policy
(``--kv-offloading-eviction-policy``): ``lru`` (``HostTier``, the default) or ``arc``
(``ArcTier``). Both keep the same slots, pins and methods; only the victim differs."""

from __future__ import annotations

from typing import TypeAlias, get_args

from tokenwire.runtime.config import KVTierEvictionPolicy
from tokenwire.runtime.core.arc_tier import ArcTier
from tokenwire.runtime.core.host_tier import HostTier

EvictionPolicy: TypeAlias = KVTierEvictionPolicy
EVICTION_POLICIES: tuple[EvictionPolicy, ...] = get_args(EvictionPolicy)
TierIndex: TypeAlias = HostTier | ArcTier


def new_tier_index(num_slots: int, policy: EvictionPolicy = "lru") -> TierIndex:
    """An empty index of ``num_slots`` slots under ``policy``."""
    if policy == "arc":
        return ArcTier(num_slots)
    if policy == "lru":
        return HostTier(num_slots)
    raise ValueError(f"unknown KV tier eviction policy {policy!r}; expected lru or arc")
