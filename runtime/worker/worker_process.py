"""One tensor-parallel rank in a process of its own: join the group, load the model shard,
then run every step rank 0 broadcasts.

Rank 0 pulls steps from the engine core (ZMQ) and pushes back each ``ModelOutput``; the other
ranks only listen to rank 0's broadcasts, so a rank on another node (``tokenwire worker``)
needs nothing but the rendezvous address. While the core is idle rank 0 broadcasts a
heartbeat, so a silent or dead peer surfaces within ``--distributed-timeout`` even then, and
the group's short collective timeout turns any hang into an error. A rank never outlives its
parent (the core, or the ``tokenwire worker`` process of its node).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.distributed.init import destroy, init_tp_group
from tokenwire.runtime.ipc.lifeline import watch_parent
from tokenwire.runtime.ipc.sockets import send_or_drop
from tokenwire.runtime.ipc.worker_messages import (
    ExecutorCodec,
    Heartbeat,
    Step,
    StepDone,
    Stop,
    WorkerFailed,
    WorkerReady,
)
from tokenwire.runtime.worker.worker import Worker, cpu_threads_per_rank, resolve_device

logger = logging.getLogger("tokenwire.worker")
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [rank %(rank)s pid %(process)d] %(message)s"


@dataclass(frozen=True)
class WorkerSpec:
    config: EngineConfig
    rank: int
    local_rank: int
    init_method: str
    # Where the core sends steps: every rank's own socket on one node; rank 0's only (it
    # broadcasts to the group) when ranks live on several nodes.
    step_address: str | None = None
    report_address: str | None = None  # ranks on the core's node: where they report

    @property
    def world_size(self) -> int:
        return self.config.parallel.tensor_parallel_size


def worker_process(spec: WorkerSpec, parent_pipe: Connection) -> None:
    """Process entry (spawned): serve steps until ``Stop``; exit 1 on any failure."""
    import zmq

    # The parent owns the lifetime: a signal to the whole process group must not kill a
    # rank mid-step; the rank ends on Stop, or at once when its parent is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent(parent_pipe)
    logging.basicConfig(
        level=logging.WARNING, format=_LOG_FORMAT.replace("%(rank)s", str(spec.rank))
    )
    context = zmq.Context()
    report = steps = None
    if spec.report_address is not None:
        report = context.socket(zmq.PUSH)
        report.connect(spec.report_address)
    if spec.step_address is not None:
        steps = context.socket(zmq.PULL)
        steps.connect(spec.step_address)
    code = _run(spec, steps, report)
    for sock in (steps, report):
        if sock is not None:
            sock.close(linger=2000)  # deliver a last report before leaving
    context.term()
    os._exit(code)


def _run(spec: WorkerSpec, steps: Any, report: Any) -> int:
    codec = ExecutorCodec()
    started = False
    try:
        worker = _start(spec)
        started = True
        dist = torch.distributed
        num_blocks = torch.tensor([worker.num_blocks], dtype=torch.int64)
        dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN)  # every rank can hold this many
        weight_bytes = torch.tensor([worker.weight_bytes], dtype=torch.int64)
        dist.all_reduce(weight_bytes)  # the whole model, all ranks together
        if spec.rank == 0 and report is not None:
            facts = worker.facts(int(num_blocks.item()), int(weight_bytes.item()))
            send_or_drop(report, codec.encode(WorkerReady(facts)))
        serve_steps(worker, worker.tp, steps, report, spec.config.parallel.distributed_timeout)
    except BaseException as exc:  # report, never die silently
        if started:
            logger.exception("rank %d failed", spec.rank)
        message = str(exc) if not started else f"rank {spec.rank} failed: {type(exc).__name__}"
        if report is not None:
            send_or_drop(
                report, codec.encode(WorkerFailed(spec.rank, message, startup=not started))
            )
        elif not started:  # a rank of another node: its own log is the only place to say it
            logger.error("rank %d could not start: %s", spec.rank, message)
        return 1
    destroy()
    return 0


def _start(spec: WorkerSpec) -> Worker:
    config = spec.config
    parallel = config.parallel
    device = resolve_device(config.device, spec.local_rank, parallel.ranks_per_node)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(parallel.cpu_ranks_per_node))
    else:
        torch.cuda.set_device(device)
    tp = init_tp_group(
        spec.init_method,
        spec.world_size,
        spec.rank,
        device,
        parallel.distributed_timeout,
        parallel.distributed_startup_timeout,
        broadcasts_steps=parallel.nnodes > 1,
    )
    return Worker(config, device, tp)


def next_step(tp: TPGroup, steps: Any, codec: ExecutorCodec, heartbeat_s: float) -> Any:
    """The next ``Step`` or ``Stop`` for this rank.

    One node: every rank has its own socket from the core (measured one-way: 36 us median
    for a 64-request decode step vs 169 us through a gloo broadcast, whose p99 is 2 ms;
    ``scripts/step_broadcast_cost.py``). Several nodes: rank 0 alone has a socket and
    broadcasts over the group, heartbeating while the core is idle so the group's short
    collective timeout never fires on an idle engine and a dead peer is still noticed."""
    if tp.world_size == 1 or not tp.broadcasts_steps:
        return codec.decode(steps.recv(copy=False).buffer)
    heartbeat = codec.encode(Heartbeat())
    while True:
        data: bytes | None = None
        if tp.is_driver:
            data = steps.recv() if steps.poll(max(1, int(1000 * heartbeat_s))) else heartbeat
        message = codec.decode(tp.broadcast_bytes(data))
        if not isinstance(message, Heartbeat):
            return message


def serve_steps(worker: Worker, tp: TPGroup, steps: Any, report: Any, timeout: float) -> None:
    """The step loop every rank runs: every rank executes each step; rank 0 reports the
    ``ModelOutput``; ``Stop`` ends it."""
    codec = ExecutorCodec()
    while True:
        message = next_step(tp, steps, codec, timeout / 4)
        if isinstance(message, Stop):
            return
        assert isinstance(message, Step), message
        output = worker.execute_model(message.scheduler_output)
        if tp.is_driver:
            send_or_drop(report, codec.encode(StepDone(output)))
