"""The executor seam under ``EngineCore``: ``execute_model(SchedulerOutput) -> ModelOutput``.

The core holds one executor and never touches a model or a device itself. What it needs of
the model (vocabulary, context length, EOS ids, KV blocks, names) arrives once as a plain
``ModelFacts`` record, the same whether the model runs in the core's process
(``UniprocExecutor``) or sharded over worker processes (``MultiprocExecutor``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.scheduler_output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the engine core knows about the loaded model (plain data, crosses processes)."""

    served_model_name: str
    arch: ModelArch
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: str  # "float32", "bfloat16", ...
    device: str  # rank 0's device ("cpu", "cuda:0")
    model_path: str  # the HF-format directory the weights came from
    tokenizer_path: str | None  # None: the model has no tokenizer (token ids only)
    num_blocks: int  # KV blocks every rank holds (the minimum over ranks)
    tensor_parallel_size: int = 1
    quantization: str | None = None  # the weight scheme; None: unquantized
    weight_bytes: int = 0  # bytes of weights on all ranks together, as loaded

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size


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


def make_executor(config: EngineConfig) -> Executor:
    """``UniprocExecutor`` for one rank, ``MultiprocExecutor`` for a tensor-parallel group."""
    if config.parallel.tensor_parallel_size == 1:
        from tokenwire.runtime.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config)
    from tokenwire.runtime.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)
