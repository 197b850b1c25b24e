"""The paged KV cache tensors: per layer ``(k_cache, v_cache)``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. Block 0 is the null block.

Under tensor parallelism each rank caches only its own KV heads
(``arch.num_local_kv_heads(tp_size)``: a share of them, or one replicated head), so every
function here takes the TP size; the block count is per rank (ranks agree on it: the engine
takes the minimum over ranks).

Sizing: on CPU from ``CacheConfig.kv_cache_memory_bytes``; on CUDA the model runner profiles
a forward pass and passes ``num_blocks`` in (``kv_cache_sizing``); without it, CUDA falls back
to ``gpu_memory_utilization`` of the device's total memory minus what is already allocated
(model weights) and a fixed activation reserve. ``num_blocks_override`` wins over all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenwire.runtime.config import CacheConfig
from tokenwire.runtime.models.arch import ModelArch

# CUDA activation reserve when no profiled block count is passed in (bytes).
_CUDA_ACTIVATION_RESERVE = 2 << 30


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """KV bytes of one block on one rank (all layers, K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads = arch.num_local_kv_heads(tp_size)
    return 2 * arch.num_hidden_layers * block_size * heads * arch.head_dim * elem


def num_blocks_for(
    arch: ModelArch,
    cache_config: CacheConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp_size: int = 1,
) -> int:
    """Blocks that fit one rank's budget (CPU: ``kv_cache_memory_bytes`` per rank)."""
    if cache_config.num_blocks_override is not None:
        return cache_config.num_blocks_override
    per_block = bytes_per_block(arch, cache_config.block_size, dtype, tp_size)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * cache_config.gpu_memory_utilization)
        budget -= torch.cuda.memory_allocated(device) + _CUDA_ACTIVATION_RESERVE
        flag = "--gpu-memory-utilization"
    else:
        budget = cache_config.kv_cache_memory_bytes
        flag = "--kv-cache-memory"
    num_blocks = budget // per_block
    if num_blocks < 2:
        raise ValueError(
            f"no room for the KV cache ({budget} bytes available, {per_block} per block): "
            f"raise {flag}"
        )
    return int(num_blocks)


@dataclass(frozen=True)
class KVCache:
    num_blocks: int
    block_size: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @staticmethod
    def allocate(
        arch: ModelArch,
        cache_config: CacheConfig,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int | None = None,
        tp_size: int = 1,
    ) -> KVCache:
        """This rank's cache. ``num_blocks``: a count already sized for this device (CUDA
        profiling, or the minimum over TP ranks)."""
        if num_blocks is None:
            num_blocks = num_blocks_for(arch, cache_config, device, dtype, tp_size)
        shape = (
            arch.num_hidden_layers,
            2,
            num_blocks,
            cache_config.block_size,
            arch.num_local_kv_heads(tp_size),
            arch.head_dim,
        )
        # Zeroed: masked-out slots are multiplied by 0 in attention, and 0 * NaN garbage = NaN.
        storage = torch.zeros(shape, dtype=dtype, device=device)
        layers = [(storage[i, 0], storage[i, 1]) for i in range(arch.num_hidden_layers)]
        return KVCache(num_blocks, cache_config.block_size, layers)
