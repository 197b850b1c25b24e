"""``UniprocExecutor``: the model on one device, in the engine core's own process."""

from __future__ import annotations

import torch

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.model_facts import ModelFacts
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.scheduler_output import SchedulerOutput
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

    @property
    def facts(self) -> ModelFacts:
        return self._facts

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        return self.worker.execute_model(scheduler_output)

    def check_health(self) -> None:
        pass

    def shutdown(self, graceful: bool = True) -> None:
        pass
