"""Plain records of the KV-connector seam (docs/kv-tiers.md): what the scheduler-side part
(``core/kv_connector.py``) asks the worker-side part (``worker/kv_offload.py``) to copy.

They ride in ``SchedulerOutput.kv_transfers`` (every rank gets the same plan) and the worker
acknowledges finished loads in ``ModelOutput.kv_loads_done``. Block ids index the device KV
cache; slots index the host tier's buffer. Ordering contract, per step: the saves run and
finish before this step's forward (the blocks they read may be overwritten by it), then the
new loads start (after the saves, so a slot saved this step can be loaded this step); a load
may finish during any later step and is reported once, by id.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class KVLoad:
    """Copy host slots ``slots[i]`` into device block ``block_ids[i]``."""

    load_id: int
    slots: list[int]
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class KVTransferPlan:
    """One step's copies. ``save_block_ids[i]`` goes to host slot ``save_slots[i]``."""

    save_block_ids: list[int] = field(default_factory=list)
    save_slots: list[int] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)
    # Loads started in earlier steps and not acknowledged yet: the worker polls them (and, in
    # a step with nothing to compute, waits a little for them instead of spinning).
    num_loads_in_flight: int = 0
