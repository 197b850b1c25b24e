"""The executor for an engine config: one rank in the core's process, or a TP group."""

from __future__ import annotations

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    """``UniprocExecutor`` for one rank, ``MultiprocExecutor`` for a tensor-parallel group."""
    if config.parallel.tensor_parallel_size == 1:
        from tokenwire.runtime.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config)
    from tokenwire.runtime.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)
