"""``tokenwire worker``: the tensor-parallel ranks of one node other than node 0.

Node 0 runs ``tokenwire serve`` (the engine core spawns its own ranks); every other node runs
``tokenwire worker`` with the same engine flags plus ``--node-rank``. Its ranks meet node 0's
at the rendezvous and follow rank 0's broadcasts; they need no other connection. The command
ends when its ranks do: 0 after the engine's clean stop, 1 when any rank failed (the others
are stopped with it), so a supervisor restarts the node.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
from multiprocessing.connection import wait
from typing import Any

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.distributed.init import rendezvous_method
from tokenwire.runtime.worker.worker_process import WorkerSpec, worker_process

logger = logging.getLogger("tokenwire.worker")


def run_node(config: EngineConfig) -> int:
    parallel = config.parallel
    if parallel.node_rank == 0 or parallel.nnodes == 1:
        raise ValueError(
            "--node-rank must be >= 1 and --nnodes > 1 for `tokenwire worker` "
            "(node 0 runs `tokenwire serve`)"
        )
    init_method = rendezvous_method(parallel)
    assert init_method is not None  # several nodes always have one
    spawn = multiprocessing.get_context("spawn")
    processes: list[Any] = []
    pipes = []
    first = parallel.node_rank * parallel.ranks_per_node
    for local_rank in range(parallel.ranks_per_node):
        spec = WorkerSpec(
            config, rank=first + local_rank, local_rank=local_rank, init_method=init_method
        )
        child_end, parent_end = spawn.Pipe(duplex=False)
        process = spawn.Process(target=worker_process, args=(spec, child_end))
        process.start()
        child_end.close()
        processes.append(process)
        pipes.append(parent_end)
    logger.warning(
        "node %d: ranks %d-%d joining %s", parallel.node_rank, first,
        first + parallel.ranks_per_node - 1, init_method,
    )  # fmt: skip
    return _supervise(processes, pipes)


def _supervise(processes: list[Any], pipes: list[Any]) -> int:
    """Wait for the ranks; the first failure (or SIGTERM / SIGINT) stops them all."""
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        for process in processes:
            process.kill()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    pending = list(processes)
    while pending:
        for sentinel in wait([p.sentinel for p in pending]):
            done = next(p for p in pending if p.sentinel == sentinel)
            done.join()
            pending.remove(done)
            if done.exitcode != 0 and code == 0:
                code = 1
                for other in pending:
                    other.kill()
    for pipe in pipes:
        pipe.close()
    return 1 if stopping else code
