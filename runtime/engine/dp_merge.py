"""How ``DPCoreClient`` turns several engine cores' answers into one: the stats snapshot the
gauges read (sums; usage over all blocks; each core's own kept in ``ranks``), the idle report
(every core idle and free), the snapshot before the first step (every core's blocks free) and
a LoRA change (the first core's error, else its adapter)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from tokenwire.runtime.engine.messages import LoRAReply
from tokenwire.runtime.engine.protocol import EngineInfo, EngineStatsSnapshot, IdleReport
from tokenwire.runtime.stats import KVOffloadStats

_SUMMED = (
    "num_running",
    "num_waiting",
    "kv_blocks_free",
    "kv_blocks_total",
    "num_held_blocks",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
)


def merge_snapshots(snapshots: Sequence[EngineStatsSnapshot]) -> EngineStatsSnapshot:
    summed = {name: sum(getattr(s, name) for s in snapshots) for name in _SUMMED}
    total = summed["kv_blocks_total"]
    used = sum(s.kv_cache_usage * s.kv_blocks_total for s in snapshots)
    return EngineStatsSnapshot(
        step_id=max(s.step_id for s in snapshots),
        kv_cache_usage=used / total if total else 0.0,
        running_lora_adapters=_union(s.running_lora_adapters for s in snapshots),
        waiting_lora_adapters=_union(s.waiting_lora_adapters for s in snapshots),
        kv_offload=_merge_offload([s.kv_offload for s in snapshots]),
        ranks=tuple(snapshots),
        **summed,
    )


def idle_snapshot(info: EngineInfo) -> EngineStatsSnapshot:
    """The state before the first step: every block of every core free (with several cores,
    the sum over them, each core's own in ``ranks``)."""
    ranks = [
        EngineStatsSnapshot(kv_blocks_free=n, kv_blocks_total=n)
        for n in info.rank_kv_blocks or (info.num_kv_blocks,)
    ]
    return ranks[0] if len(ranks) == 1 else merge_snapshots(ranks)


def _union(names: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    return tuple(sorted({n for group in names for n in group}))


def _merge_offload(stats: list[KVOffloadStats | None]) -> KVOffloadStats | None:
    present = [s for s in stats if s is not None]
    if not present:
        return None
    fields = {
        f.name: sum(getattr(s, f.name) for s in present) for f in dataclasses.fields(present[0])
    }
    return KVOffloadStats(**fields)


def merge_idle(reports: Sequence[IdleReport]) -> IdleReport:
    errors = [f"rank {i}: {r.invariant_error}" for i, r in enumerate(reports) if r.invariant_error]
    return IdleReport(
        has_unfinished_requests=any(r.has_unfinished_requests for r in reports),
        num_free_blocks=sum(r.num_free_blocks for r in reports),
        num_blocks=sum(r.num_blocks for r in reports),
        num_held_blocks=sum(r.num_held_blocks for r in reports),
        num_tier_held_blocks=sum(r.num_tier_held_blocks for r in reports),
        invariant_error="; ".join(errors) or None,
    )


def merge_lora(replies: Sequence[LoRAReply]) -> LoRAReply:
    """Every core loads or drops the same adapter; the first refusal is the answer."""
    return next((r for r in replies if r.error), replies[0])
