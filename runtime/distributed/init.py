"""Joining a tensor-parallel group: rendezvous, backends and timeouts for one rank."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch

from tokenwire.runtime.config import ParallelConfig
from tokenwire.runtime.distributed.group import TPGroup


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a single-node rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rendezvous_method(parallel: ParallelConfig) -> str | None:
    """The init method every rank uses; None: single node, pick a free loopback port."""
    if parallel.distributed_init_method is not None:
        return parallel.distributed_init_method
    if parallel.nnodes > 1:
        return f"tcp://{parallel.master_addr}:{parallel.master_port}"
    return None


def init_tp_group(
    init_method: str,
    world_size: int,
    rank: int,
    device: torch.device,
    timeout: float,
    startup_timeout: float,
    broadcasts_steps: bool = False,
) -> TPGroup:
    """Join the group (waiting at most ``startup_timeout`` s for every rank), then make the
    groups the engine runs on, whose collectives give up after ``timeout`` s: NCCL on CUDA
    (gloo on CPU) for tensors, gloo for host-side messages."""
    dist = torch.distributed
    backend = "nccl" if device.type == "cuda" else "gloo"
    # The default group (startup timeout) takes host tensors too: startup agreement (KV
    # blocks) runs on it while ranks still load at different speeds.
    default_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
    try:
        dist.init_process_group(
            default_backend,
            init_method=init_method,
            world_size=world_size,
            rank=rank,
            timeout=timedelta(seconds=startup_timeout),
        )
    except Exception as exc:  # DistStoreError (a missing peer), a refused connection, ...
        raise RuntimeError(
            f"rank {rank} of {world_size} could not join the tensor-parallel group at "
            f"{init_method} within {startup_timeout:g} s ({type(exc).__name__}): check "
            "that every node started (--nnodes, --node-rank, --master-addr, --master-port) "
            "or raise --distributed-startup-timeout"
        ) from exc
    short = timedelta(seconds=timeout)
    device_group = dist.new_group(backend=backend, timeout=short)
    cpu_group = device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=short)
    return TPGroup(rank, world_size, device_group, cpu_group, broadcasts_steps=broadcasts_steps)


def destroy() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
