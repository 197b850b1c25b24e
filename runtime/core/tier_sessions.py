"""Which KV-tier slots idle Sessions pin (docs/kv-tiers.md "Sessions on the tiers").

An idle Session's held table that leaves the device moves to the host tier while it fits
there next to what is pinned already and within the Sessions' share of it
(``session_cache_fraction`` of the slots; a slot two Sessions share counts once), else to the
disk tier while it fits there; its slots stay pinned until its next turn is admitted or it
closes. The scheduler thread owns it; the connector does the saves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenwire.runtime.core.block_pool import KVBlock
from tokenwire.runtime.core.disk_tier import DiskTier
from tokenwire.runtime.core.tier_index import TierIndex


class SessionPins:
    def __init__(self, host: TierIndex, disk: DiskTier | None, max_host_slots: int) -> None:
        self.host = host
        self.disk = disk
        self.max_host_slots = max_host_slots
        self._host: dict[str, list[int]] = {}  # holder id -> its pinned host slots
        self._disk: dict[str, list[int]] = {}  # holder id -> its pinned disk records

    def __contains__(self, holder_id: str) -> bool:
        return holder_id in self._host or holder_id in self._disk

    def holders(self) -> list[str]:
        return sorted([*self._host, *self._disk])

    @property
    def num_blocks(self) -> int:
        """Slots pinned, per Session (a shared slot counts for each)."""
        return sum(map(len, self._host.values())) + sum(map(len, self._disk.values()))

    def fits_host(self, hashes: Sequence[bytes]) -> bool:
        return self.host.can_take(hashes) and self._host_slots_with(hashes) <= self.max_host_slots

    def fits_disk(self, hashes: Sequence[bytes]) -> bool:
        return self.disk is not None and self.disk.index.can_take(hashes)

    def _host_slots_with(self, hashes: Sequence[bytes]) -> int:
        """Host slots Sessions would pin with ``hashes`` held too."""
        pinned = {slot for slots in self._host.values() for slot in slots}
        slots = [self.host.peek(h) for h in set(hashes)]
        new = {slot for slot in slots if slot is not None and slot not in pinned}
        return len(pinned) + len(new) + slots.count(None)

    def add_host(self, holder_id: str, slots: list[int]) -> None:
        """The Session holds ``slots``, which the caller has pinned once each for it."""
        self._host[holder_id] = slots

    def add_disk(self, holder_id: str, records: list[int]) -> None:
        """The Session holds ``records``, which the caller has pinned once each for it."""
        self._disk[holder_id] = records

    def release(self, holder_id: str) -> bool:
        """Unpin the Session's slots (they become ordinary LRU entries); False: none held."""
        host = self._host.pop(holder_id, None)
        if host is not None:
            self.host.unpin(host)
        disk = self._disk.pop(holder_id, None)
        if disk is not None and self.disk is not None:
            self.disk.unpin(disk)
        return host is not None or disk is not None


def save_pinned(
    tier: TierIndex,
    blocks: Sequence[tuple[KVBlock, bytes]],
    save: Callable[[int, bytes], int | None],
) -> list[int] | None:
    """Save a Session's ``blocks`` into ``tier`` (``save(block_id, hash)``: the slot holding
    it after) and pin each slot once; the slots already holding one of them are pinned first,
    so no save of this table evicts another of its blocks (what ``can_take`` counted on).
    None (nothing stays pinned): a save found no slot."""
    here = [s for s in (tier.peek(h) for _, h in blocks) if s is not None]
    tier.pin(here)
    slots: list[int] = []
    for block, block_hash in blocks:
        slot = save(block.block_id, block_hash)
        if slot is None:  # not expected after ``can_take``; never a half-held Session
            tier.unpin(slots)
            slots = []
            break
        tier.pin([slot])
        slots.append(slot)
    tier.unpin(here)
    return slots or None
