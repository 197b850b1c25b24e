"""What every KV tier's slot index shares, whatever its eviction policy (``host_tier.py``:
LRU, ``arc_tier.py``: ARC): ``num_slots`` fixed slots, the free ones, the pins of loads in
flight (a pinned slot is never a victim), the ``can_take`` and leading-run lookups built on a
policy's ``peek`` / ``get``, and the slot invariants. Pure Python; the scheduler thread owns
it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class TierSlots:
    """Free slots and pins; a subclass keeps which hash lives in which used slot."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"a KV tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out 0 first
        self._pins: dict[int, int] = {}  # slot -> number of loads in flight reading it

    def __len__(self) -> int:
        raise NotImplementedError

    def peek(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash``, or None; nothing is touched."""
        raise NotImplementedError

    def get(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash`` (touched, as the policy counts a use), or None."""
        raise NotImplementedError

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def can_take(self, block_hashes: Sequence[bytes]) -> bool:
        """Whether ``block_hashes`` can all be here at once, pinned, without evicting a pinned
        slot or one of them: a slot each for those not here, free or unpinned."""
        here = {s for h in block_hashes if (s := self.peek(h)) is not None}
        missing = len(set(block_hashes)) - len(here)
        evictable = len(self) - len(set(self._pins) | here)
        return missing <= len(self._free) + evictable

    def lookup_run(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Slots of the longest leading run of ``block_hashes`` held here (each touched)."""
        slots: list[int] = []
        for block_hash in block_hashes:
            slot = self.get(block_hash)
            if slot is None:
                break
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

    def _take_restored(self, slots: Iterable[int]) -> None:
        """The slots a warm restart's records hold are no longer free."""
        taken = set(slots)
        self._free = [s for s in self._free if s not in taken]

    def _reset_slots(self) -> None:
        self._free = list(range(self.num_slots - 1, -1, -1))

    def _check_slots(self, used: list[int], idle: bool) -> None:
        """The invariants of the used slots ``used`` (one per resident hash)."""
        check(len(set(used)) == len(used), "a tier slot holds two hashes")
        check(not set(used) & set(self._free), "a tier slot is both used and free")
        check(len(used) + len(self._free) == self.num_slots, "a tier slot is lost")
        check(set(self._pins) <= set(used), "a pinned tier slot holds no hash")
        check(not idle or not self._pins, f"idle but tier slots are pinned: {self._pins}")


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


__all__ = ["TierSlots", "check"]
