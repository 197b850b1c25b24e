"""The executor seam under ``EngineCore``: ``execute_model(SchedulerOutput) -> ModelOutput``.

The core holds one executor and never touches a model or a device itself. What it needs of
the model (vocabulary, context length, EOS ids, KV blocks, names) arrives once as a plain
``ModelFacts`` record, the same whether the model runs in the core's process
(``UniprocExecutor``) or sharded over worker processes (``MultiprocExecutor``).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol, runtime_checkable

from tokenwire.runtime.model_facts import ModelFacts
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.scheduler_output import SchedulerOutput
from tokenwire.runtime.structured.bitmask import GrammarBitmask


class Executor(Protocol):
    @property
    def facts(self) -> ModelFacts: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelOutput: ...

    def check_health(self) -> None:
        """Raise when a worker is gone (called by an idle engine core, ~every second)."""
        ...

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers: ``graceful`` lets them finish and exit on their own; otherwise
        they are killed at once (the engine is dead; a hung worker would never exit)."""
        ...


@runtime_checkable
class AsyncExecutor(Executor, Protocol):
    """An executor that can take step k+1 while step k runs (async scheduling): it runs the
    submitted steps one at a time, in order, so a step sees every earlier step's effects (its
    sampled tokens, its KV writes).

    ``late_bitmask``: the step's grammar bitmask arrives later (the core builds it once the
    step before is reconciled); the step runs its forward meanwhile and waits for it only to
    sample."""

    def submit_model(
        self,
        scheduler_output: SchedulerOutput,
        late_bitmask: Future[GrammarBitmask | None] | None = None,
    ) -> Future[ModelOutput]: ...
