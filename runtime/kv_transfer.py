"""Plain records of the KV-connector seam (docs/kv-tiers.md): what the scheduler-side part
(``core/kv_connector.py``) asks the worker-side part (``worker/kv_offload.py``) to copy.

They ride in ``SchedulerOutput.kv_transfers`` (every rank gets the same plan) and the worker
acknowledges finished loads in ``ModelOutput.kv_loads_done``. Block ids index the device KV
cache; slots index the host tier's buffer. Ordering contract, per step: the saves run and
finish before this step's forward (the blocks they read may be overwritten by it), then the
new loads start (after the saves, so a slot saved this step can be loaded this step); a load
may finish during any later step and is reported once, by id.

The disk tier (``--kv-offloading-disk-path``): ``disk_writes`` copy a host slot (the LRU
victim of one of this step's saves) or a device block (no host slot was free) into a record of
the disk file. Their sources are read before this step's saves and forward; the writes and
disk reads run in order on one I/O thread, so a read always sees every earlier write. A disk
read whose record fails its checks is reported in ``ModelOutput.kv_load_failed`` (its device
block holds nothing usable) instead of being served.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class DiskRead:
    """Load the disk record in ``slot`` (it must hold ``block_hash``) into device block
    ``block_id``."""

    slot: int
    block_id: int
    block_hash: bytes


@dataclass(frozen=True, slots=True)
class DiskWrite:
    """Write ``block_hash``'s KV into disk record ``slot``, from host slot ``host_slot`` or,
    when that is -1, from device block ``block_id``."""

    slot: int
    block_hash: bytes
    host_slot: int = -1
    block_id: int = -1


@dataclass(frozen=True, slots=True)
class KVLoad:
    """Copy host slots ``slots[i]`` into device block ``block_ids[i]``, and the disk reads."""

    load_id: int
    slots: list[int]
    block_ids: list[int]
    disk: list[DiskRead] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class KVTransferPlan:
    """One step's copies. ``save_block_ids[i]`` goes to host slot ``save_slots[i]``."""

    save_block_ids: list[int] = field(default_factory=list)
    save_slots: list[int] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)
    # Loads started in earlier steps and not acknowledged yet: the worker polls them (and, in
    # a step with nothing to compute, waits a little for them instead of spinning).
    num_loads_in_flight: int = 0
    disk_writes: list[DiskWrite] = field(default_factory=list)
    # ``reset_prefix_cache`` cleared the disk tier: before this step's disk writes, the worker
    # zeroes every record's header, so no load and no restart takes one over.
    disk_clear: bool = False
