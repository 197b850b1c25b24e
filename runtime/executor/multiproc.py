"""``MultiprocExecutor``: the model sharded over a tensor-parallel group of worker processes.

The engine core (the scheduler stays single) spawns this node's ranks, one process per
device, which meet at the rendezvous with the ranks other nodes start (``tokenwire worker``).
Each step's ``SchedulerOutput`` goes to rank 0 over a ZMQ ``ipc://`` socket and from there to
every rank; rank 0 returns the ``ModelOutput``. Every rank reports its KV capacity and the
group takes the minimum.

Faults: a local rank that exits is seen at once (its process sentinel, checked while a step
is awaited); a remote rank that dies or hangs makes rank 0's next collective fail within
``--distributed-timeout`` and rank 0 reports it. Either way ``execute_model`` raises, the
engine core dies, and every rank follows its parent out.
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import tempfile
import time
from typing import Any

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.distributed.init import free_loopback_port, rendezvous_method
from tokenwire.runtime.ipc.sockets import send_or_drop
from tokenwire.runtime.ipc.worker_messages import (
    ExecutorCodec,
    Step,
    StepDone,
    Stop,
    WorkerFailed,
    WorkerReady,
)
from tokenwire.runtime.model_facts import ModelFacts
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.scheduler_output import SchedulerOutput
from tokenwire.runtime.worker.worker_process import WorkerSpec, worker_process

logger = logging.getLogger("tokenwire.executor")
_POLL_MS = 100  # how often a waiting core looks at its workers' process sentinels


class WorkerDeadError(RuntimeError):
    """A rank of the tensor-parallel group died or failed: the engine cannot go on."""


class MultiprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        import zmq

        parallel = config.parallel
        if parallel.node_rank != 0:
            raise ValueError(
                f"--node-rank {parallel.node_rank}: nodes other than 0 run `tokenwire worker`"
            )
        self.config = config
        self._closed = False
        self._codec = ExecutorCodec()
        self._dir = tempfile.mkdtemp(prefix="tokenwire-tp-")
        self._context = zmq.Context()
        # One node: a socket to every rank; several: to rank 0, which broadcasts.
        self._num_step_sockets = parallel.ranks_per_node if parallel.nnodes == 1 else 1
        self._steps = []
        for rank in range(self._num_step_sockets):
            steps = self._context.socket(zmq.PUSH)
            steps.setsockopt(zmq.SNDHWM, 0)
            steps.bind(f"ipc://{self._dir}/steps-{rank}")
            self._steps.append(steps)
        self._reports = self._context.socket(zmq.PULL)
        self._reports.setsockopt(zmq.RCVHWM, 0)
        self._reports.bind(f"ipc://{self._dir}/reports")
        init_method = rendezvous_method(parallel) or f"tcp://127.0.0.1:{free_loopback_port()}"
        self._processes, self._pipes = self._spawn(init_method)
        try:
            self._facts = self._await_ready(parallel.distributed_startup_timeout)
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, init_method: str) -> tuple[list[Any], list[Any]]:
        spawn = multiprocessing.get_context("spawn")
        processes, pipes = [], []
        for local_rank in range(self.config.parallel.ranks_per_node):
            spec = WorkerSpec(
                self.config,
                rank=local_rank,
                local_rank=local_rank,
                init_method=init_method,
                step_address=(
                    f"ipc://{self._dir}/steps-{local_rank}"
                    if local_rank < self._num_step_sockets
                    else None
                ),
                report_address=f"ipc://{self._dir}/reports",
            )
            child_end, parent_end = spawn.Pipe(duplex=False)
            process = spawn.Process(
                target=worker_process, args=(spec, child_end), name=f"tokenwire-rank{local_rank}"
            )
            process.start()
            child_end.close()
            processes.append(process)
            pipes.append(parent_end)
        return processes, pipes

    @property
    def facts(self) -> ModelFacts:
        return self._facts

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._processes]

    def _await_ready(self, timeout: float) -> ModelFacts:
        message = self._receive(deadline=time.monotonic() + timeout + 30)
        if isinstance(message, WorkerReady):
            return message.facts
        raise WorkerDeadError(f"unexpected first message from rank 0: {type(message).__name__}")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        self._send(Step(scheduler_output))
        message = self._receive(deadline=None)
        if not isinstance(message, StepDone):
            raise WorkerDeadError(f"unexpected message from rank 0: {type(message).__name__}")
        output: ModelOutput = message.model_output
        return output

    def check_health(self) -> None:
        """Raise ``WorkerDeadError`` if a rank on this node exited or one reported failure."""
        for rank, process in enumerate(self._processes):
            if process.exitcode is not None:
                if self._reports.poll(0):
                    self._receive(deadline=0.0)  # its failure report says more
                raise WorkerDeadError(
                    f"tensor-parallel rank {rank} exited with code {process.exitcode}"
                )

    def _send(self, message: Step | Stop) -> None:
        data = self._codec.encode(message)  # encoded once, whatever the number of ranks
        for steps in self._steps:
            send_or_drop(steps, data)

    def _receive(self, deadline: float | None) -> Any:
        """The next report; raises when a rank failed, a local rank exited, or the
        deadline passed. Startup failures raise ``ValueError`` (they name what to change)."""
        while not self._reports.poll(_POLL_MS):
            dead = [
                (i, p.exitcode) for i, p in enumerate(self._processes) if p.exitcode is not None
            ]
            if dead and not self._reports.poll(0):
                rank, code = dead[0]
                raise WorkerDeadError(f"tensor-parallel rank {rank} exited with code {code}")
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDeadError("the tensor-parallel ranks did not report in time")
        message = self._codec.decode(self._reports.recv(copy=False).buffer)
        if isinstance(message, WorkerFailed):
            if message.startup:
                raise ValueError(message.message)
            raise WorkerDeadError(message.message)
        return message

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every rank (Stop through rank 0, then kill what is left; at once unless
        ``graceful``) and clean up."""
        if self._closed:
            return
        self._closed = True
        if graceful and self._processes[0].exitcode is None:
            self._send(Stop())
        deadline = time.monotonic() + (10.0 if graceful else 0.0)
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join()
        for pipe in self._pipes:
            pipe.close()
        for steps in self._steps:
            steps.close(linger=0)
        self._reports.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
