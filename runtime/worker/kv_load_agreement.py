"""Tensor parallelism and the KV tiers: a load counts as finished when it has finished on
every rank (docs/kv-tiers.md).

Every rank runs the same ``KVTransferPlan`` on its own shard of each block (its KV heads),
with its own host buffer and disk file, and its copies finish at their own pace. The engine
core admits a request whose blocks were loaded once rank 0 reports the load done, and the
next forward on every rank then reads those blocks; so rank 0 may report a load only when
each rank has finished it. Likewise a block whose disk record failed its checks on any rank
is recomputed, never read: a hit is a hit on every rank or none.

``LoadAgreement`` keeps the loads started and not yet agreed, in start order (the same on
every rank: the plans are), and each step exchanges one small vector over the group's gloo
group: per load, "not finished here", and per device block, "failed here", reduced with MAX.
The exchange happens only while loads are pending, which every rank sees alike.
"""

from __future__ import annotations

import torch

from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.kv_transfer import KVLoad


def load_blocks(load: KVLoad) -> list[int]:
    """The device blocks ``load`` writes: its host slots' blocks, then its disk reads'."""
    return [*load.block_ids, *(read.block_id for read in load.disk)]


class LoadAgreement:
    """The loads started on this rank and not yet finished on every rank."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.pending: list[KVLoad] = []
        self.local: dict[int, list[int]] = {}  # finished here: load id -> failed blocks

    def started(self, loads: list[KVLoad]) -> None:
        self.pending.extend(loads)

    def agree(self, finished_here: dict[int, list[int]]) -> tuple[list[int], list[int]]:
        """``finished_here``: loads this rank finished since the last call (id -> blocks
        whose record failed here). Returns the loads finished on every rank and the blocks
        among them that failed on any rank; a collective when loads are pending."""
        self.local.update(finished_here)
        if not self.pending:
            return [], []
        flags = [0 if load.load_id in self.local else 1 for load in self.pending]
        for load in self.pending:
            failed = set(self.local.get(load.load_id, ()))
            flags += [1 if block in failed else 0 for block in load_blocks(load)]
        vector = torch.tensor(flags, dtype=torch.int32)
        if self.tp.world_size > 1:
            torch.distributed.all_reduce(
                vector, op=torch.distributed.ReduceOp.MAX, group=self.tp.cpu_group
            )
        return self._take(vector.tolist())

    def _take(self, flags: list[int]) -> tuple[list[int], list[int]]:
        pending, offset = self.pending, len(self.pending)
        done: list[int] = []
        failed: list[int] = []
        kept: list[KVLoad] = []
        for j, load in enumerate(pending):
            blocks = load_blocks(load)
            if flags[j]:
                kept.append(load)
            else:
                done.append(load.load_id)
                failed += [b for b, bad in zip(blocks, flags[offset:], strict=False) if bad]
                del self.local[load.load_id]
            offset += len(blocks)
        self.pending = kept
        return done, failed
