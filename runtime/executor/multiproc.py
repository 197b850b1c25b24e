"""``MultiprocExecutor``: the model sharded over a tensor-parallel group of worker processes.

The engine core (the scheduler stays single) spawns this node's ranks, one process per
device, which meet at the rendezvous with the ranks other nodes start (``tokenwire worker``).
Each step's ``SchedulerOutput`` goes to rank 0 over a ZMQ ``ipc://`` socket and from there to
every rank; rank 0 returns the ``ModelOutput``. Every rank reports its KV capacity and the
group takes the minimum.

Async scheduling (``submit_model``): a sender thread puts each step on the ranks' sockets in
submission order (a step whose grammar bitmask comes late is sent once it has it, with the
bitmask in the step), so step k+1 is queued at the ranks before step k's result is collected;
the ranks run steps in order, and a receiver thread matches their reports to the submitted
steps in the same order. The core's thread never touches the sockets while a step is in
flight (the idle health check runs with nothing in flight).

Faults: a local rank that exits is seen at once (its process sentinel, checked while a step
is awaited); a remote rank that dies or hangs makes rank 0's next collective fail within
``--distributed-timeout`` and rank 0 reports it. Either way ``execute_model`` raises, the
engine core dies, and every rank follows its parent out.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
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
from tokenwire.runtime.structured.bitmask import GrammarBitmask
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
        # Async scheduling, made on first use: one thread sends steps, one collects results.
        self._sender: ThreadPoolExecutor | None = None
        self._receiver: ThreadPoolExecutor | None = None
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
        return self._step_done()

    def submit_model(
        self,
        scheduler_output: SchedulerOutput,
        late_bitmask: Future[GrammarBitmask | None] | None = None,
    ) -> Future[ModelOutput]:
        """Queue a step behind the ones submitted before it (async scheduling): it reaches
        the ranks while they run those; the future holds its ``ModelOutput``."""
        if self._sender is None or self._receiver is None:
            self._sender = ThreadPoolExecutor(1, thread_name_prefix="tokenwire-tp-send")
            self._receiver = ThreadPoolExecutor(1, thread_name_prefix="tokenwire-tp-collect")
        sent = self._sender.submit(self._send_late, scheduler_output, late_bitmask)
        return self._receiver.submit(self._collect, sent)

    def _send_late(
        self, so: SchedulerOutput, late_bitmask: Future[GrammarBitmask | None] | None
    ) -> None:
        """Sender thread: send ``so``, with its grammar bitmask once the core has built it."""
        if late_bitmask is not None:
            so = dataclasses.replace(so, grammar_bitmask=late_bitmask.result())
        self._send(Step(so))

    def _collect(self, sent: Future[None]) -> ModelOutput:
        """Receiver thread: the result of the step ``sent`` sent (reports come in order)."""
        sent.result()  # not sent (its bitmask failed): no report will come for it
        return self._step_done()

    def _step_done(self) -> ModelOutput:
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
        if self._sender is not None:  # every submitted step is sent (or failed) first
            self._sender.shutdown(wait=True)
        if graceful and self._processes[0].exitcode is None:
            self._send(Stop())
        deadline = time.monotonic() + (10.0 if graceful else 0.0)
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join()
        if self._receiver is not None:  # the ranks are gone: a pending collect fails now
            self._receiver.shutdown(wait=True, cancel_futures=True)
        for pipe in self._pipes:
            pipe.close()
        for steps in self._steps:
            steps.close(linger=0)
        self._reports.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
