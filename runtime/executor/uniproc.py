"""``UniprocExecutor``: the model on one device, in the engine core's own process.

Async scheduling (``submit_model``): steps run on one forward thread of this process, in
submission order, while the core's thread plans the next step (torch releases the GIL).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.model_facts import ModelFacts
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.scheduler_output import SchedulerOutput
from tokenwire.runtime.structured.bitmask import GrammarBitmask
from tokenwire.runtime.worker.worker import Worker, cpu_threads_per_rank, resolve_device


class UniprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        device = resolve_device(config.device)
        parallel = config.parallel
        if parallel.data_parallel_size > 1 and device.type == "cpu":
            # Several engine cores on this node: each takes its share of the cores.
            torch.set_num_threads(cpu_threads_per_rank(parallel.cpu_ranks_per_node))
        elif parallel.data_parallel_size > 1 and device.index is None:
            device = torch.device(device.type, parallel.data_parallel_rank)  # a GPU per core
        self.worker = Worker(config, device, TPGroup.single())
        self._facts = self.worker.facts(self.worker.num_blocks)
        self._forward: ThreadPoolExecutor | None = None  # async scheduling: made on first use

    @property
    def facts(self) -> ModelFacts:
        return self._facts

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        return self.worker.execute_model(scheduler_output)

    def submit_model(
        self,
        scheduler_output: SchedulerOutput,
        late_bitmask: Future[GrammarBitmask | None] | None = None,
    ) -> Future[ModelOutput]:
        if self._forward is None:  # one thread: steps run one at a time, in order
            self._forward = ThreadPoolExecutor(1, thread_name_prefix="tokenwire-forward")
        return self._forward.submit(self.worker.execute_model, scheduler_output, late_bitmask)

    def check_health(self) -> None:
        pass

    def shutdown(self, graceful: bool = True) -> None:
        if self._forward is not None:
            self._forward.shutdown(wait=graceful, cancel_futures=not graceful)
        self.worker.shutdown()
