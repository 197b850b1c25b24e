"""ARC bookkeeping for a KV tier (``--kv-offloading-eviction-policy arc``): the same slots,
pins and methods as ``HostTier`` (LRU), with Megiddo and Modha's Adaptive Replacement Cache
choosing the victim.

Resident hashes sit in two LRU lists: ``T1`` (seen once since they arrived) and ``T2`` (seen
again: a prefix hit, or saved a second time). Two ghost lists remember the hashes evicted from
each (``B1``, ``B2``; hashes only, no slot). A miss that is found in a ghost list moves the
target size ``p`` of ``T1``: towards recency after a ``B1`` ghost, towards frequency after a
``B2`` ghost. The victim is ``T1``'s least recently used when ``T1`` is over its target, else
``T2``'s. So a scan of blocks used once (a batch of unique prompts) evicts other once-used
blocks and leaves the reused ones (a shared system prompt, an agent's transcript) in place,
where LRU would flush them.

Pins work as in ``HostTier``: a pinned slot is never a victim; when the preferred list holds
only pinned slots the other list gives one, and when every resident slot is pinned the save is
dropped. Bounds (``check_invariants``): ``|T1| + |B1| <= slots``, all four lists together
``<= 2 * slots``, ``0 <= p <= slots``. Pure Python; the scheduler thread owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tokenwire.runtime.core.tier_slots import TierSlots, check


class ArcTier(TierSlots):
    """``num_slots`` tier blocks under ARC; the interface of ``HostTier``."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.target = 0.0  # p: the size T1 aims at
        self._t1: OrderedDict[bytes, int] = OrderedDict()  # front = least recently used
        self._t2: OrderedDict[bytes, int] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._t1 or block_hash in self._t2

    @property
    def recent_size(self) -> int:
        """``|T1|``: resident hashes seen once."""
        return len(self._t1)

    def put(self, block_hash: bytes) -> int | None:
        """The slot a save of ``block_hash`` must write, or None: already here (now seen
        again), or every slot is pinned (the save is dropped)."""
        return self.put_evicting(block_hash)[0]

    def put_evicting(self, block_hash: bytes) -> tuple[int | None, bytes | None]:
        """``put``, and the hash it evicted from the returned slot (None: the slot was free)."""
        if block_hash in self:
            self.get(block_hash)
            return None, None
        in_b1, in_b2 = block_hash in self._b1, block_hash in self._b2
        if in_b1:  # evicted while once-used: recency deserved more room
            self.target = min(self.num_slots, self.target + max(len(self._b2) / len(self._b1), 1))
        elif in_b2:  # evicted while reused: frequency deserved more room
            self.target = max(0.0, self.target - max(len(self._b1) / len(self._b2), 1))
        victim = None
        if self._free:
            slot = self._free.pop()
        else:
            found = self._evict(hit_in_b2=in_b2)
            if found is None:
                return None, None
            victim, slot = found
        self._b1.pop(block_hash, None)
        self._b2.pop(block_hash, None)
        (self._t2 if in_b1 or in_b2 else self._t1)[block_hash] = slot
        self._trim_ghosts()
        return slot, victim

    def _evict(self, hit_in_b2: bool) -> tuple[bytes, int] | None:
        """Take an unpinned resident out (into its ghost list): ARC's REPLACE."""
        t1_over = len(self._t1) > self.target or (hit_in_b2 and len(self._t1) == self.target)
        order = (self._t1, self._t2) if self._t1 and t1_over else (self._t2, self._t1)
        for resident in order:
            victim = next((h for h, s in resident.items() if s not in self._pins), None)
            if victim is not None:
                slot = resident.pop(victim)
                (self._b1 if resident is self._t1 else self._b2)[victim] = None
                return victim, slot
        return None

    def _trim_ghosts(self) -> None:
        """Keep ``|T1| + |B1| <= c`` and the directory ``<= 2c`` (oldest ghosts go first)."""
        c = self.num_slots
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while len(self) + len(self._b1) + len(self._b2) > 2 * c:
            (self._b2 if self._b2 else self._b1).popitem(last=False)

    def peek(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash``, or None; nothing is touched."""
        slot = self._t1.get(block_hash)
        return self._t2.get(block_hash) if slot is None else slot

    def get(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash`` (touched: into ``T2``, most recently used)."""
        slot = self._t1.pop(block_hash, None)
        if slot is None:
            slot = self._t2.get(block_hash)
            if slot is not None:
                self._t2.move_to_end(block_hash)
            return slot
        self._t2[block_hash] = slot
        return slot

    def remove(self, block_hash: bytes) -> bool:
        """Forget ``block_hash`` (its record is bad); refused (False) while a load pins it."""
        slot = self.peek(block_hash)
        if slot is None or slot in self._pins:
            return False
        self._t1.pop(block_hash, None)
        self._t2.pop(block_hash, None)
        self._free.append(slot)
        return True

    def restore(self, entries: Sequence[tuple[bytes, int]]) -> None:
        """Take over records found at startup (warm restart), least recently used first: all
        in ``T1`` (nothing is known of their reuse yet)."""
        for block_hash, slot in entries:
            self._t1[block_hash] = slot
        self._take_restored(slot for _, slot in entries)

    def clear(self) -> bool:
        """Forget every hash and ghost; refused (False) while a load reads a slot."""
        if self._pins:
            return False
        for lists in (self._t1, self._t2, self._b1, self._b2):
            lists.clear()
        self._reset_slots()
        self.target = 0.0
        return True

    def check_invariants(self, idle: bool = False) -> None:
        self._check_slots([*self._t1.values(), *self._t2.values()], idle)
        c = self.num_slots
        check(not self._t1.keys() & self._t2.keys(), "a hash is in T1 and T2")
        ghosts = self._b1.keys() | self._b2.keys()
        check(not ghosts & (self._t1.keys() | self._t2.keys()), "a resident hash is a ghost")
        check(len(self._t1) + len(self._b1) <= c, "T1 + B1 exceed the tier")
        check(len(self) + len(self._b1) + len(self._b2) <= 2 * c, "ARC's directory > 2c")
        check(0.0 <= self.target <= c, f"ARC's target {self.target} is out of [0, {c}]")
