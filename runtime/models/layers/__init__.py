"""Model layers: plain (``basic``) and tensor-parallel (``parallel``) building blocks."""

from tokenwire.runtime.models.layers.basic import Embedding, Linear, RMSNorm
from tokenwire.runtime.models.layers.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    ShardedModule,
    ShardLoads,
    VocabParallelEmbedding,
    vocab_parallel_logits,
    vocab_shard,
)

__all__ = [
    "Embedding",
    "Linear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RowParallelLinear",
    "ShardLoads",
    "ShardedModule",
    "VocabParallelEmbedding",
    "vocab_parallel_logits",
    "vocab_shard",
]
