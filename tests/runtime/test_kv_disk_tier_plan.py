"""The disk tier's scheduler side (real scheduler, block manager and connector; the worker's
acknowledgements given by hand through the plain-data seam): what each step's plan asks, the
order rule the worker relies on (a disk write reads a host slot before the step's save
overwrites it, and no slot is saved twice in one step), a failed disk read is not cached and
is forgotten, and the idle invariants of every tier."""

from __future__ import annotations

from test_kv_offload import BLOCK, request

from tokenwire.runtime.config import SchedulerConfig
from tokenwire.runtime.core.host_tier import HostTier
from tokenwire.runtime.core.kv_cache_manager import KVCacheManager
from tokenwire.runtime.core.kv_connector import OffloadingConnector
from tokenwire.runtime.core.kv_tier_setup import attach_offloading
from tokenwire.runtime.core.scheduler import Scheduler
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.scheduler_output import SchedulerOutput

PROMPT_A = list(range(10, 27))  # 4 full blocks


def make(disk_slots: int = 64) -> tuple[Scheduler, KVCacheManager, OffloadingConnector]:
    kv = KVCacheManager(13, BLOCK, True)
    connector = attach_offloading(kv, num_slots=2, block_bytes=1, disk_slots=disk_slots)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    return Scheduler(config, kv, 256, connector=connector), kv, connector


def step(sched: Scheduler, plans: list[SchedulerOutput], fail: bool = False) -> None:
    """One step with a fake model; its loads acknowledged (``fail``: every disk read bad)."""
    so = sched.schedule()
    plans.append(so)
    ids, tokens = [], []
    for rid, n in so.num_scheduled_tokens.items():
        req = sched.requests[rid]
        if req.num_computed_tokens + n == req.num_tokens:
            ids.append(rid)
            tokens.append(7)
    loads = so.kv_transfers.loads if so.kv_transfers else []
    failed = [r.block_id for x in loads for r in x.disk] if fail else []
    done = [x.load_id for x in loads]
    sched.update(so, ModelOutput(ids, tokens, kv_loads_done=done, kv_load_failed=failed))
    sched.kv.check_invariants()
    assert sched.connector is not None
    sched.connector.check_invariants()


def run(sched: Scheduler, plans: list[SchedulerOutput], fail: bool = False) -> None:
    for _ in range(100):
        if not sched.has_unfinished_requests():
            return
        step(sched, plans, fail)
    raise AssertionError("the scheduler never went idle")


def evict_a(sched: Scheduler, plans: list[SchedulerOutput]) -> None:
    sched.add_request(request("a", PROMPT_A))
    run(sched, plans)
    for i, base in enumerate((100, 200)):  # two long prompts: A leaves the device and host
        sched.add_request(request(f"b{i}", list(range(base, base + 48))))
        run(sched, plans)


def assert_idle(kv: KVCacheManager, connector: OffloadingConnector) -> None:
    kv.check_invariants(idle=True)
    assert kv.num_free_blocks == kv.num_blocks
    connector.check_invariants(idle=True)


def test_disk_writes_read_host_slots_before_the_same_steps_saves() -> None:
    sched, kv, connector = make()
    plans: list[SchedulerOutput] = []
    evict_a(sched, plans)
    writes = [w for so in plans if so.kv_transfers for w in so.kv_transfers.disk_writes]
    assert any(w.host_slot >= 0 for w in writes)  # host LRU victims spilled
    assert any(w.host_slot < 0 and w.block_id >= 0 for w in writes)  # no host slot: direct
    for so in plans:
        plan = so.kv_transfers
        if plan is not None:
            # A host-sourced write reads the victim of one of this step's saves (the worker
            # reads it before the saves), and no slot is saved twice in a step, so no write
            # reads a slot's bytes from this step.
            spilled = [w.host_slot for w in plan.disk_writes if w.host_slot >= 0]
            assert len(set(spilled)) == len(spilled) and set(spilled) <= set(plan.save_slots)
            assert len(set(plan.save_slots)) == len(plan.save_slots)
    assert connector.disk is not None and len(connector.disk) == len(writes)
    assert_idle(kv, connector)


def test_a_load_from_disk_then_a_failed_one() -> None:
    sched, kv, connector = make()
    plans: list[SchedulerOutput] = []
    evict_a(sched, plans)
    assert connector.disk is not None
    a2 = request("a2", PROMPT_A)
    sched.add_request(a2)
    start = len(plans)
    run(sched, plans)
    (load,) = [x for so in plans[start:] if so.kv_transfers for x in so.kv_transfers.loads]
    assert load.disk and len(load.slots) + len(load.disk) == 4
    assert a2.num_cached_tokens == 16
    assert connector.stats().disk_blocks_loaded == len(load.disk)
    assert_idle(kv, connector)
    # A again, after B's pushed it out once more; this time every disk read fails its checks.
    for i, base in enumerate((300, 400)):
        sched.add_request(request(f"c{i}", list(range(base, base + 48))))
        run(sched, plans)
    a3 = request("a3", PROMPT_A)
    sched.add_request(a3)
    start = len(plans)
    run(sched, plans, fail=True)
    (load,) = [x for so in plans[start:] if so.kv_transfers for x in so.kv_transfers.loads]
    assert load.disk and a3.num_cached_tokens <= 16 - BLOCK * len(load.disk)  # recomputed
    failed = {r.block_hash for r in load.disk}
    assert not failed & set(connector.disk.index._lru)  # forgotten: a miss from now on
    assert connector.stats().disk_load_failures == len(load.disk)
    assert_idle(kv, connector)


def test_slot_index_put_evicting_remove_and_restore() -> None:
    tier = HostTier(3)
    tier.restore([(b"x", 2), (b"y", 0)])  # oldest first
    assert tier.put_evicting(b"z") == (1, None)  # the free slot
    assert tier.put_evicting(b"w") == (2, b"x")  # the least recently used
    tier.pin([0])
    assert not tier.remove(b"y")  # pinned: a load reads it
    tier.unpin([0])
    assert tier.remove(b"y") and tier.get(b"y") is None
    tier.check_invariants(idle=True)


def test_the_disk_records_cross_the_worker_codec() -> None:
    import dataclasses

    from tokenwire.runtime.ipc.worker_messages import ExecutorCodec, Step, StepDone
    from tokenwire.runtime.kv_transfer import DiskRead, DiskWrite, KVLoad, KVTransferPlan

    plan = KVTransferPlan(
        [1], [0], [KVLoad(3, [1], [4], [DiskRead(7, 5, b"h" * 32)])], 0,
        [DiskWrite(2, b"g" * 32, host_slot=0), DiskWrite(6, b"k" * 32, block_id=9)],
    )  # fmt: skip
    sched, _, _ = make()
    so = dataclasses.replace(sched.schedule(), kv_transfers=plan)
    codec = ExecutorCodec()
    assert codec.decode(codec.encode(Step(so))) == Step(so)
    done = StepDone(ModelOutput([], [], kv_loads_done=[3], kv_load_failed=[5]))
    assert codec.decode(codec.encode(done)) == done
