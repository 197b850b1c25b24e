"""``UniprocExecutor``: the model on one device, in the engine core's own process."""

from __future__ import annotations

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.model_facts import ModelFacts
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.scheduler_output import SchedulerOutput
from tokenwire.runtime.worker.worker import Worker, resolve_device


class UniprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config, resolve_device(config.device), TPGroup.single())
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
