"""``RunnerSettings``: what the model runner and its CUDA-graph path read of the engine config.

Derived once from the frozen ``EngineConfig`` (``from_config``) and passed down whole: the
runner, its caches, the CUDA KV sizing and ``CudaGraphRunner`` take this record, not loose
scalars. Each field keeps its flag's name from the flag to where it is used:
``--max-num-seqs`` is ``max_num_seqs`` in the ``SchedulerConfig``, here, in the input batch
and host staging rows and in ``kernels.cuda_graph_buckets.decode_batch_buckets``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenwire.runtime.config import CacheConfig, EngineConfig, LoRAConfig


@dataclass(frozen=True)
class RunnerSettings:
    cache: CacheConfig
    lora: LoRAConfig
    # Sequences in one step: input batch rows, staging rows, the largest decode graph bucket.
    max_num_seqs: int
    max_num_batched_tokens: int  # tokens in one step: staging size, the profiling batch
    # --enforce-eager: no decode CUDA graphs (LoRA steps replay them too: ``cuda_graphs``).
    enforce_eager: bool
    cpu_compile: bool  # --cpu-compile: the CPU forward as one inductor graph (worker.cpu_compile)
    seed: int  # the engine generator's seed (unseeded random rows)

    @classmethod
    def from_config(cls, config: EngineConfig) -> RunnerSettings:
        sched = config.scheduler
        return cls(
            cache=config.cache,
            lora=config.lora,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            enforce_eager=config.enforce_eager,
            cpu_compile=config.cpu_compile,
            seed=config.model.seed,
        )
