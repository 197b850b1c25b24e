"""``TPGroup``: one tensor-parallel group, passed explicitly to whoever needs collectives.

No module-global parallel state: the model's parallel layers, the model runner and the worker
loop each hold the ``TPGroup`` they were built with. ``TPGroup.single()`` is the group of one
(every collective is the identity), so the same model code serves TP=1 without a process
group at all.

Two torch.distributed groups back a real group: ``device_group`` for tensor collectives on the
model's device (NCCL on CUDA, gloo on CPU) with a short timeout (a peer that stops answering
is a dead engine within seconds, not a hang), and ``cpu_group`` (gloo) for the small host-side
messages (each step's scheduler output, broadcast from rank 0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CollectiveClock:
    """Wall time this rank spent in the model's collectives (waiting on peers included).

    Exact on CPU, where gloo collectives are synchronous; on CUDA it counts only the time to
    enqueue NCCL work."""

    seconds: float = 0.0
    calls: int = 0


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    device_group: Any = None  # torch.distributed ProcessGroup; None for the group of one
    cpu_group: Any = None
    clock: CollectiveClock = field(default_factory=CollectiveClock, compare=False)
    # Steps reach the ranks by rank 0's broadcast (several nodes) rather than each rank's
    # own socket from the engine core (one node).
    broadcasts_steps: bool = False

    @staticmethod
    def single() -> TPGroup:
        return TPGroup()

    @property
    def is_driver(self) -> bool:
        """Rank 0: talks to the engine core and returns each step's ``ModelOutput``."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns ``tensor``."""
        if self.world_size > 1:
            started = time.perf_counter()
            torch.distributed.all_reduce(tensor, group=self.device_group)
            self._tick(started)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape on all ranks) concatenated along ``dim``."""
        if self.world_size == 1:
            return tensor
        started = time.perf_counter()
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor, group=self.device_group)
        self._tick(started)
        return torch.cat(parts, dim=dim)

    def _tick(self, started: float) -> None:
        self.clock.seconds += time.perf_counter() - started
        self.clock.calls += 1

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (other ranks pass None), over the gloo group."""
        if self.world_size == 1:
            assert data is not None
            return data
        dist = torch.distributed
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.cpu_group)
        if self.rank == 0:
            assert data is not None
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buffer = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self.cpu_group)
        return data if data is not None else buffer.numpy().tobytes()

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier(group=self.cpu_group)


def shard_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s contiguous share of ``size`` rows; ``size`` must divide."""
    if size % world_size:
        raise ValueError(f"{size} does not split evenly over {world_size} ranks")
    length = size // world_size
    return rank * length, length
