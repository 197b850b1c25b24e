"""Bookkeeping of the host KV tier: which block hashes live in which host slot, LRU order,
and the slots pinned by loads in flight. Pure Python (the bytes live in the worker's host
buffer, ``worker/kv_offload.py``); the scheduler thread owns it.

Keys are the prefix cache's chained block hashes, extra keys (cache salt, LoRA adapter)
included, so a host hit obeys the same isolation rules as a device prefix hit.

The disk tier's bookkeeping (``core/disk_tier.py``) is the same structure over the slots of
its file: a slot is a fixed-size record, so LRU by count is LRU by size.

Invariants (``check_invariants``, ``tier_slots.py``): every slot is either free or holds
exactly one hash; a pinned slot holds a hash (a load reads it) and is never handed to a save
until unpinned.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tokenwire.runtime.core.tier_slots import TierSlots


class HostTier(TierSlots):
    """``num_slots`` host blocks; ``put`` evicts the least recently used unpinned hash."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        # hash -> slot; front = least recently used (evicted first).
        self._lru: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    def put(self, block_hash: bytes) -> int | None:
        """The slot a save of ``block_hash`` must write, or None: already here (now most
        recently used), or every slot is pinned (the save is dropped)."""
        return self.put_evicting(block_hash)[0]

    def put_evicting(self, block_hash: bytes) -> tuple[int | None, bytes | None]:
        """``put``, and the hash it evicted from the returned slot (None: the slot was free)."""
        lru = self._lru
        if block_hash in lru:
            lru.move_to_end(block_hash)
            return None, None
        victim = None
        if self._free:
            slot = self._free.pop()
        else:
            pins = self._pins
            victim = next((h for h, s in lru.items() if s not in pins), None)
            if victim is None:
                return None, None
            slot = lru.pop(victim)
        lru[block_hash] = slot
        return slot, victim

    def peek(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash``, or None; the LRU order is left as it is."""
        return self._lru.get(block_hash)

    def get(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash`` (touched: most recently used), or None."""
        slot = self._lru.get(block_hash)
        if slot is not None:
            self._lru.move_to_end(block_hash)
        return slot

    def remove(self, block_hash: bytes) -> bool:
        """Forget ``block_hash`` (its record is bad); refused (False) while a load pins it."""
        slot = self._lru.get(block_hash)
        if slot is None or slot in self._pins:
            return False
        del self._lru[block_hash]
        self._free.append(slot)
        return True

    def restore(self, entries: Sequence[tuple[bytes, int]]) -> None:
        """Take over records found at startup (warm restart), least recently used first."""
        for block_hash, slot in entries:
            self._lru[block_hash] = slot
        self._take_restored(slot for _, slot in entries)

    def clear(self) -> bool:
        """Forget every hash; refused (False) while a load reads a slot."""
        if self._pins:
            return False
        self._lru.clear()
        self._reset_slots()
        return True

    def check_invariants(self, idle: bool = False) -> None:
        self._check_slots(list(self._lru.values()), idle)
