"""Bookkeeping of the host KV tier: which block hashes live in which host slot, LRU order,
and the slots pinned by loads in flight. Pure Python (the bytes live in the worker's host
buffer, ``worker/kv_offload.py``); the scheduler thread owns it.

Keys are the prefix cache's chained block hashes, extra keys (cache salt, LoRA adapter)
included, so a host hit obeys the same isolation rules as a device prefix hit.

The disk tier's bookkeeping (``core/disk_tier.py``) is the same structure over the slots of
its file: a slot is a fixed-size record, so LRU by count is LRU by size.

Invariants (``check_invariants``): every slot is either free or holds exactly one hash; a
pinned slot holds a hash (a load reads it) and is never handed to a save until unpinned.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class HostTier:
    """``num_slots`` host blocks; ``put`` evicts the least recently used unpinned hash."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"the host tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        # hash -> slot; front = least recently used (evicted first).
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out 0 first
        # slot -> number of loads in flight reading it.
        self._pins: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

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

    def can_take(self, block_hashes: Sequence[bytes]) -> bool:
        """Whether ``block_hashes`` can all be here at once, pinned, without evicting a pinned
        slot or one of them: a slot each for those not here, free or unpinned."""
        here = {self._lru[h] for h in block_hashes if h in self._lru}
        missing = len(set(block_hashes)) - len(here)
        evictable = len(self._lru) - len(set(self._pins) | here)
        return missing <= len(self._free) + evictable

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
        taken = {slot for _, slot in entries}
        for block_hash, slot in entries:
            self._lru[block_hash] = slot
        self._free = [s for s in self._free if s not in taken]

    def lookup_run(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Slots of the longest leading run of ``block_hashes`` held here (touched: MRU)."""
        lru = self._lru
        slots: list[int] = []
        for block_hash in block_hashes:
            slot = lru.get(block_hash)
            if slot is None:
                break
            lru.move_to_end(block_hash)
            slots.append(slot)
        return slots

    def pin(self, slots: Iterable[int]) -> None:
        pins = self._pins
        for slot in slots:
            pins[slot] = pins.get(slot, 0) + 1

    def unpin(self, slots: Iterable[int]) -> None:
        pins = self._pins
        for slot in slots:
            left = pins[slot] - 1
            if left:
                pins[slot] = left
            else:
                del pins[slot]

    def clear(self) -> bool:
        """Forget every hash; refused (False) while a load reads a slot."""
        if self._pins:
            return False
        self._lru.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        return True

    def check_invariants(self, idle: bool = False) -> None:
        used = list(self._lru.values())
        _check(len(set(used)) == len(used), "a host slot holds two hashes")
        _check(not set(used) & set(self._free), "a host slot is both used and free")
        _check(len(used) + len(self._free) == self.num_slots, "a host slot is lost")
        _check(set(self._pins) <= set(used), "a pinned host slot holds no hash")
        _check(not idle or not self._pins, f"idle but host slots are pinned: {self._pins}")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
