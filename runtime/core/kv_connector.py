"""The scheduler-side part of a KV connector, and its first implementation: the host tier.

A connector decides, per request and per step, which blocks move between the device cache and
another store; the worker-side part (``worker/kv_offload.py``) moves them. Plain records cross
the seam (``kv_transfer.py``): the step's ``KVTransferPlan`` rides in ``SchedulerOutput``, and
finished loads come back in ``ModelOutput.kv_loads_done``. The scheduler calls the hooks
in ``core/kv_connector_api.py`` and nothing else, so another store can implement ``KVConnector``.

``OffloadingConnector`` (``--kv-offloading-size``):
- **Save at eviction.** ``BlockPool`` calls ``on_evict`` when a cached block is popped for
  reuse; its KV is still intact (the reuse is this step's forward), so the save is queued in
  this step's plan, which the worker runs before the forward. A hash already in the tier is
  only touched (no copy).
- **Load on a prefix hit that continues in the tier.** ``start_load`` takes references on the
  request's device hit, allocates fresh device blocks for the host run (uncached: nothing can
  hit them before their KV lands), pins the host slots and queues the copy. The request stays
  in the waiting queue, skipped while its load is in flight (``waiting_for_load``) and
  re-checked every step, so other requests keep running. When the worker acknowledges the
  load, the blocks are cached under their hashes and stay referenced by the connector until
  the request is admitted (``admitted``), where its normal prefix lookup hits them all.
- **Abort / finish during a load** (``request_finished``): a load in flight keeps its blocks
  until the worker acknowledges it, then frees them. Nothing half-loaded is cached or read.
- **Sessions** (``hold_session``): an idle Session's held table released under device
  pressure is saved here and its slots pinned until its next turn is admitted or it closes.
- **The disk tier** (``--kv-offloading-disk-path``, ``core/disk_tier.py``): the host tier's
  LRU victim goes to disk instead of being dropped (read from its slot before this step's save
  overwrites it: a slot saved this step is pinned until the plan is built, so it is never a
  victim in the same step); a device block with no free host slot goes to disk directly. A
  load takes each block from the host tier, else from the disk (disk -> device); a disk record
  that fails its checks is reported by the worker and its block is not cached (a miss).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from tokenwire.runtime.core.block_pool import BlockPool, KVBlock
from tokenwire.runtime.core.disk_tier import DiskTier
from tokenwire.runtime.core.kv_events import MEDIUM_CPU
from tokenwire.runtime.core.pending_load import PendingLoad
from tokenwire.runtime.core.request import Request
from tokenwire.runtime.core.tier_index import EvictionPolicy, new_tier_index
from tokenwire.runtime.core.tier_sessions import SessionPins, save_pinned
from tokenwire.runtime.kv_transfer import DiskRead, KVLoad, KVTransferPlan
from tokenwire.runtime.stats import KVOffloadStats


class OffloadingConnector:
    """The host tier behind the ``KVConnector`` seam. ``max_held_fraction``: loads (in flight
    or waiting for admission) reference at most this share of the device blocks."""

    def __init__(
        self,
        pool: BlockPool,
        num_slots: int,
        block_bytes: int,
        max_held_fraction: float = 0.9,
        disk: DiskTier | None = None,
        session_fraction: float = 1.0,
        eviction_policy: EvictionPolicy = "lru",
    ) -> None:
        self.pool = pool
        self.tier = new_tier_index(num_slots, eviction_policy)
        self.disk = disk
        self.block_bytes = block_bytes
        self.max_held = max(1, int(pool.num_usable_blocks * max_held_fraction))
        self._loads: dict[str, PendingLoad] = {}  # by request id: the request's load
        self._in_flight: dict[int, PendingLoad] = {}  # by load id, until acknowledged
        self._num_held = 0
        self._save_block_ids: list[int] = []
        self._save_slots: list[int] = []
        self._new_loads: list[KVLoad] = []
        self._next_load_id = 0
        # KV events on: records the device blocks a load caches, as the KV cache manager
        # records those a request computes (``KVCacheManager.record_stored``).
        self.announce: Callable[[Request, Sequence[bytes], list[int]], None] | None = None
        # Idle Sessions' pinned slots; at most ``session_cache_fraction`` of the host tier's
        # (as of the device cache), so prefix traffic always keeps the rest.
        self.sessions = SessionPins(self.tier, disk, int(num_slots * session_fraction))
        self._blocks_saved = self._blocks_loaded = 0
        self._load_time = 0.0

    @property
    def has_pending(self) -> bool:
        return bool(self._in_flight)

    # ------------------------------------------------------------------ save
    def on_evict(self, block: KVBlock) -> None:
        """``block`` (cached, free) is being reused: queue its KV for the host tier."""
        assert block.block_hash is not None
        self._save(block.block_id, block.block_hash)

    def _save(self, block_id: int, block_hash: bytes) -> int | None:
        """Queue device block ``block_id``'s KV for the host tier under ``block_hash`` (only
        touched when it is there already); its host slot, or None (disk, or dropped)."""
        if block_hash in self.tier:
            return self.tier.get(block_hash)  # touched: most recently used
        slot, victim = self.tier.put_evicting(block_hash)
        if slot is None:  # every host slot is read by a load or saved this step
            if self.disk is not None:
                self.disk.save(block_hash, block_id=block_id)
            return None
        events = self.pool.events
        if victim is not None:
            if events is not None:
                events.removed(victim, MEDIUM_CPU)
            if self.disk is not None:
                self.disk.save(victim, host_slot=slot)  # read before this step's save
        if events is not None:
            events.tier_stored(block_hash, MEDIUM_CPU)
        self.tier.pin([slot])  # saved this step: no victim until the plan is built
        self._save_block_ids.append(block_id)
        self._save_slots.append(slot)
        self._blocks_saved += 1
        return slot

    # ------------------------------------------------------------------ sessions
    def hold_session(self, holder_id: str, blocks: Sequence[tuple[KVBlock, bytes]]) -> bool:
        """An idle Session's held table is being released under device pressure: save its
        hashed blocks to the host tier, or when it does not fit there (``SessionPins``) to the
        disk tier (copied before this step's forward either way), pinned for the Session until
        its next turn is admitted or it closes. False (nothing changes): no tier fits it."""
        hashes = [h for _, h in blocks]
        if not hashes or holder_id in self.sessions:
            return False
        if self.sessions.fits_host(hashes):
            slots = save_pinned(self.tier, blocks, self._save)
            if slots is not None:
                self.sessions.add_host(holder_id, slots)
            return slots is not None
        disk = self.disk
        if disk is None or not self.sessions.fits_disk(hashes):
            return False

        def save_to_disk(block_id: int, block_hash: bytes) -> int | None:
            disk.save(block_hash, block_id=block_id)  # only touched if it is there
            return disk.index.peek(block_hash)

        records = save_pinned(disk.index, blocks, save_to_disk)
        if records is not None:
            self.sessions.add_disk(holder_id, records)
        return records is not None

    def unhold_session(self, holder_id: str) -> bool:
        """The Session's next turn was admitted (its blocks are on the device), or it closed:
        its slots become ordinary LRU entries. False: it held none."""
        return self.sessions.release(holder_id)

    # ------------------------------------------------------------------ load
    def waiting_for_load(self, request_id: str) -> bool:
        load = self._loads.get(request_id)
        return load is not None and not load.done

    def start_load(
        self, request: Request, block_hashes: Sequence[bytes], hit_ids: Sequence[int]
    ) -> bool:
        request_id = request.request_id
        if request_id in self._loads:  # loaded already: admit with what is on the device
            return False
        sources = self._lookup(block_hashes[len(hit_ids) :])
        if not sources:
            return False
        pool = self.pool
        hit_blocks = [pool.blocks[i] for i in hit_ids]
        evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        room = min(
            pool.num_free_blocks - evictable_hits,
            self.max_held - self._num_held - len(hit_blocks),
        )
        sources = sources[: max(0, room)]
        if not sources:
            return False
        slots = [s for s, on_disk in sources if not on_disk]
        disk_slots = [s for s, on_disk in sources if on_disk]
        # Pin first: the allocation below may evict device blocks, whose saves take slots.
        self.tier.pin(slots)
        if self.disk is not None:
            self.disk.pin(disk_slots)
        pool.touch(hit_blocks)
        new_blocks = pool.get_new_blocks(len(sources))
        start = len(hit_ids)
        hashes = list(block_hashes[start : start + len(sources)])
        load = PendingLoad(
            self._next_load_id, request, hit_blocks, new_blocks, hashes, slots, disk_slots
        )
        self._next_load_id += 1
        self._loads[request_id] = self._in_flight[load.load_id] = load
        self._num_held += len(hit_blocks) + len(new_blocks)
        host_ids = [b.block_id for b, (_, d) in zip(new_blocks, sources, strict=True) if not d]
        reads = [
            DiskRead(slot, block.block_id, block_hash)
            for block, block_hash, (slot, on_disk) in zip(new_blocks, hashes, sources, strict=True)
            if on_disk
        ]
        self._new_loads.append(KVLoad(load.load_id, slots, host_ids, reads))
        return True

    def _lookup(self, block_hashes: Sequence[bytes]) -> list[tuple[int, bool]]:
        """(slot, on disk) of the longest leading run of ``block_hashes`` held by a tier,
        each from the host tier when it is there (every hit touched: most recently used)."""
        sources: list[tuple[int, bool]] = []
        for block_hash in block_hashes:
            slot = self.tier.get(block_hash)
            if slot is None and self.disk is not None:
                disk_slot = self.disk.get(block_hash)
                if disk_slot is None:
                    break
                sources.append((disk_slot, True))
            elif slot is None:
                break
            else:
                sources.append((slot, False))
        return sources

    def loads_done(self, load_ids: Sequence[int], failed: Sequence[int] = ()) -> None:
        """The worker finished these loads: their blocks hold the tiers' KV now, except the
        ``failed`` device blocks (a disk record that failed its checks: not cached, a miss)."""
        now = time.monotonic()
        bad_ids = set(failed)
        for load_id in load_ids:
            load = self._in_flight.pop(load_id)
            self.tier.unpin(load.slots)
            bad: list[bytes] = []
            stored: list[int] = []  # indices in the request's table, newly cached
            first = len(load.hit_blocks)
            for j, (block, block_hash) in enumerate(
                zip(load.new_blocks, load.block_hashes, strict=True)
            ):
                if block.block_id in bad_ids:
                    bad.append(block_hash)
                elif self.pool.cache_full_block(block, block_hash):
                    stored.append(first + j)
            if stored and self.announce is not None:  # KV events: device blocks again
                chain = [b.block_hash or b"" for b in load.hit_blocks] + load.block_hashes
                self.announce(load.request, chain, stored)
            if self.disk is not None:
                self.disk.unpin(load.disk_slots)
                self.disk.loaded(len(load.disk_slots), bad)
            load.done = True
            self._blocks_loaded += len(load.new_blocks) - len(bad)
            self._load_time += now - load.started
            load.request.tier_loaded_blocks += len(load.new_blocks) - len(bad)
            load.request.tier_load_time += now - load.started
            if load.cancelled:
                self._release(load)

    def admitted(self, request_id: str) -> None:
        """The request took its own references on its prefix hit: drop the connector's."""
        load = self._loads.pop(request_id, None)
        if load is not None:
            assert load.done, f"{request_id} admitted while its load is in flight"
            self._release(load)

    def release_ready(self, keep: str) -> bool:
        """Free the blocks of one finished load waiting for admission (not ``keep``'s), so a
        request that cannot allocate gets room; False if there is none."""
        for request_id, load in self._loads.items():
            if load.done and request_id != keep:
                del self._loads[request_id]
                self._release(load)
                return True
        return False

    def request_finished(self, request_id: str) -> None:
        """Finished or aborted (wherever it was): free what its load holds, once it may."""
        load = self._loads.pop(request_id, None)
        if load is None:
            return
        if load.done:
            self._release(load)
        else:
            load.cancelled = True  # freed by ``loads_done``: the worker is writing the blocks

    def _release(self, load: PendingLoad) -> None:
        blocks = load.blocks()
        self.pool.free_blocks(reversed(blocks))
        self._num_held -= len(blocks)

    # ------------------------------------------------------------------ the step's plan
    def build_plan(self) -> KVTransferPlan | None:
        """This step's copies; None when there is nothing to copy or to wait for."""
        has_writes = self.disk is not None and self.disk.has_writes
        if not (self._save_block_ids or self._new_loads or self._in_flight or has_writes):
            return None
        self.tier.unpin(self._save_slots)  # saved this step: evictable from the next step on
        writes, clear = ([], False) if self.disk is None else self.disk.take_writes()
        plan = KVTransferPlan(
            self._save_block_ids,
            self._save_slots,
            self._new_loads,
            len(self._in_flight) - len(self._new_loads),
            writes,
            clear,
        )
        self._save_block_ids, self._save_slots, self._new_loads = [], [], []
        return plan

    # ------------------------------------------------------------------ state
    def block_refs(self) -> dict[int, int]:
        """Device block id -> references the connector holds (for the pool's invariants)."""
        refs: dict[int, int] = {}
        for load in {id(x): x for x in (*self._loads.values(), *self._in_flight.values())}.values():
            for block in load.blocks():
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        return refs

    def stats(self) -> KVOffloadStats:
        disk = {} if self.disk is None else self.disk.stats(self.block_bytes)
        return KVOffloadStats(
            **disk,
            capacity_blocks=self.tier.num_slots,
            used_blocks=len(self.tier),
            blocks_saved=self._blocks_saved,
            blocks_loaded=self._blocks_loaded,
            bytes_saved=self._blocks_saved * self.block_bytes,
            bytes_loaded=self._blocks_loaded * self.block_bytes,
            loads_in_flight=len(self._in_flight),
            load_time=self._load_time,
            session_blocks=self.sessions.num_blocks,
        )

    def reset(self) -> bool:
        """Forget every tier's hashes (``reset_prefix_cache``); refused (nothing changes) while
        loads run or a Session holds host slots."""
        if self._loads or self._in_flight or self.sessions.holders():
            return False
        return self.tier.clear() and (self.disk is None or self.disk.clear())

    def check_invariants(self, idle: bool = False) -> None:
        self.tier.check_invariants(idle)
        if self.disk is not None:
            self.disk.check_invariants(idle)
        held = sum(len(x.blocks()) for x in {id(x): x for x in self._loads.values()}.values())
        held += sum(len(x.blocks()) for x in self._in_flight.values() if x.cancelled)
        _check(held == self._num_held, f"connector holds {held} blocks, counted {self._num_held}")
        for load in self._in_flight.values():
            _check(not load.done, f"load {load.load_id} acknowledged but still in flight")
        if idle:
            _check(not self._loads, f"idle but loads remain for {sorted(self._loads)}")
            _check(not self._in_flight, "idle but loads are in flight")
            _check(not self._save_block_ids and not self._new_loads, "idle but copies queued")
            holders = self.sessions.holders()
            _check(not holders, f"idle but Sessions hold slots: {holders}")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
