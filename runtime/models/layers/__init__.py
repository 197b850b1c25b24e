"""Model layers: plain (``basic``) and tensor-parallel (``parallel``) building blocks; the
quantized-linear seam and its schemes live in ``quant``."""

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
from tokenwire.runtime.models.layers.quant.base import (
    LinearLayer,
    LinearMethod,
    ParamLayout,
    QuantConfig,
    process_weights_after_loading,
)
from tokenwire.runtime.models.layers.quant.unquantized import UnquantizedLinearMethod

__all__ = [
    "Embedding",
    "Linear",
    "LinearLayer",
    "LinearMethod",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "ParamLayout",
    "QKVParallelLinear",
    "QuantConfig",
    "RMSNorm",
    "RowParallelLinear",
    "ShardLoads",
    "ShardedModule",
    "UnquantizedLinearMethod",
    "VocabParallelEmbedding",
    "process_weights_after_loading",
    "vocab_parallel_logits",
    "vocab_shard",
]
