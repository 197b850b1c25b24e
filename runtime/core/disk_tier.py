"""Bookkeeping of the disk KV tier (``--kv-offloading-disk-path``; docs/kv-tiers.md), under
the host tier: which block hashes live in which record of the disk file, LRU order, pins by
loads in flight, the step's queued writes and the counters. Pure Python (the bytes live in
the worker's file, ``worker/kv_disk.py``); the scheduler thread owns it.

Blocks arrive when the host tier evicts them (LRU), or straight from the device when every
host slot is taken this step; same keys as the other tiers (chained block hashes with their
extra keys). A record that fails its checks at load is forgotten (``failed``), so the hash is
a miss from then on. Warm restart: ``entries`` (what the worker found in the file at startup,
oldest first) seed the index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenwire.runtime.core.kv_events import MEDIUM_DISK, KVEventRecorder
from tokenwire.runtime.core.tier_index import EvictionPolicy, new_tier_index
from tokenwire.runtime.kv_transfer import DiskWrite


class DiskTier:
    def __init__(
        self,
        num_slots: int,
        entries: Sequence[tuple[bytes, int]] = (),
        events: KVEventRecorder | None = None,
        eviction_policy: EvictionPolicy = "lru",
    ) -> None:
        self.index = new_tier_index(num_slots, eviction_policy)
        self.index.restore(entries)
        self.events = events  # KV events (medium DISK); None when they are off
        if events is not None:  # a warm restart's records, in the first step's batch
            for block_hash, _ in entries:
                events.tier_stored(block_hash, MEDIUM_DISK)
        self.num_restored = len(entries)
        self._writes: list[DiskWrite] = []
        self._clear = False  # cleared: the worker must zero the file's records (next plan)
        self.blocks_saved = 0
        self.blocks_loaded = 0
        self.load_failures = 0

    @property
    def num_slots(self) -> int:
        return self.index.num_slots

    def __len__(self) -> int:
        return len(self.index)

    def save(self, block_hash: bytes, host_slot: int = -1, block_id: int = -1) -> None:
        """Queue ``block_hash``'s KV for the disk (from a host slot, else a device block); a
        hash already on disk is only touched, and a save is dropped if every record is pinned."""
        slot, victim = self.index.put_evicting(block_hash)
        if slot is not None:
            self._writes.append(DiskWrite(slot, block_hash, host_slot, block_id))
            self.blocks_saved += 1
            if self.events is not None:
                if victim is not None:
                    self.events.removed(victim, MEDIUM_DISK)
                self.events.tier_stored(block_hash, MEDIUM_DISK)

    def get(self, block_hash: bytes) -> int | None:
        return self.index.get(block_hash)

    def pin(self, slots: Iterable[int]) -> None:
        self.index.pin(slots)

    def unpin(self, slots: Iterable[int]) -> None:
        self.index.unpin(slots)

    def loaded(self, num_blocks: int, bad_hashes: Sequence[bytes]) -> None:
        """A load read ``num_blocks`` records; ``bad_hashes`` failed their checks (the worker
        invalidated them): forget them, unless another load still pins one (it fails too)."""
        self.blocks_loaded += num_blocks - len(bad_hashes)
        self.load_failures += len(bad_hashes)
        for block_hash in bad_hashes:
            if self.index.remove(block_hash) and self.events is not None:
                self.events.removed(block_hash, MEDIUM_DISK)

    def take_writes(self) -> tuple[list[DiskWrite], bool]:
        """The queued writes, and whether the file's records must be zeroed first."""
        writes, self._writes = self._writes, []
        clear, self._clear = self._clear, False
        return writes, clear

    @property
    def has_writes(self) -> bool:
        return bool(self._writes) or self._clear

    def clear(self) -> bool:
        """Forget every record (``reset_prefix_cache``); the next plan zeroes them on disk."""
        if self._writes or not self.index.clear():
            return False
        self._clear = True
        return True

    def stats(self, block_bytes: int) -> dict[str, int]:
        """The ``KVOffloadStats`` fields of the disk tier."""
        return {
            "disk_capacity_blocks": self.num_slots,
            "disk_used_blocks": len(self),
            "disk_blocks_saved": self.blocks_saved,
            "disk_blocks_loaded": self.blocks_loaded,
            "disk_bytes_saved": self.blocks_saved * block_bytes,
            "disk_bytes_loaded": self.blocks_loaded * block_bytes,
            "disk_load_failures": self.load_failures,
        }

    def check_invariants(self, idle: bool = False) -> None:
        self.index.check_invariants(idle)
        if idle and (self._writes or self._clear):
            raise AssertionError("idle but disk writes are queued")
