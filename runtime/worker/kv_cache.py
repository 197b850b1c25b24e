"""The paged KV cache tensors: per layer ``(k_cache, v_cache)``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. Block 0 is the null block. MLA models
(DeepSeek) cache one latent per token: ``k_cache`` and ``v_cache`` are the same tensor
(``ModelArch.kv_cache_parts`` = 1), so the budget holds twice the blocks.

Under tensor parallelism each rank caches only its own KV heads
(``arch.num_local_kv_heads(tp_size)``: a share of them, or one replicated head), so every
function here takes the TP size; the block count is per rank (ranks agree on it: the engine
takes the minimum over ranks).

Sizing: on CPU from ``CacheConfig.kv_cache_memory``; on CUDA the model runner profiles
a forward pass and passes ``num_blocks`` in (``kv_cache_sizing``); without it, CUDA falls back
to ``gpu_memory_utilization`` of the device's total memory minus what is already allocated
(model weights) and a fixed activation reserve. ``num_gpu_blocks_override`` wins over all.

Storage dtype (``--kv-cache-dtype``): ``auto`` stores the model dtype; ``fp8`` stores float8
e4m3 (``kernels.kv_quant``), 1 byte per element, so the same budget holds 2x the blocks of a
bfloat16 cache and 4x those of a float32 one. An fp8 cache carries one float32 scale per layer
for K and one for V, 1.0 unless ``set_scales`` writes others (a checkpoint's, a calibration's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenwire.kernels.kv_quant import FP8_KV_DTYPE, LayerKVCache
from tokenwire.runtime.config import DEFAULT_CPU_KV_BYTES, CacheConfig
from tokenwire.runtime.models.arch import ModelArch

# CUDA activation reserve when no profiled block count is passed in (bytes).
_CUDA_ACTIVATION_RESERVE = 2 << 30


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype for ``--kv-cache-dtype`` (``auto``: the model's)."""
    return model_dtype if kv_cache_dtype == "auto" else FP8_KV_DTYPE


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """KV bytes of one block on one rank (all layers, K and V; MLA: the one latent cache)
    stored as ``dtype``."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads = arch.num_local_kv_heads(tp_size)
    return arch.kv_cache_parts * arch.num_hidden_layers * block_size * heads * arch.head_dim * elem


def kv_bytes_per_token(arch: ModelArch, dtype: torch.dtype, tp_size: int = 1) -> int:
    """KV bytes one token takes on one rank over all layers: ``2 x kv_heads x head_dim`` per
    layer, or MLA's latent ``kv_lora_rank + qk_rope_head_dim`` (replicated on every rank)."""
    return bytes_per_block(arch, 1, dtype, tp_size)


def kv_cache_summary(arch: ModelArch, cache: KVCache, tp_size: int = 1) -> str:
    """The startup line: how many tokens fit and what each one costs."""
    per_token = kv_bytes_per_token(arch, cache.dtype, tp_size)
    usable = (cache.num_blocks - 1) * cache.block_size  # block 0 is the null block
    layout = "K and V per KV head"
    if arch.mla is not None:
        layout = f"MLA latent: {arch.mla.kv_lora_rank} + {arch.mla.qk_rope_head_dim} per layer"
    return (
        f"KV cache: {cache.num_blocks - 1} blocks of {cache.block_size} tokens, {usable} tokens "
        f"fit; {per_token} bytes per token ({layout})"
    )


def num_blocks_for(
    arch: ModelArch,
    cache_config: CacheConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp_size: int = 1,
    extra_bytes_per_block: int = 0,
    usable_blocks: int | None = None,
) -> int:
    """Blocks that fit one rank's budget (CPU: ``kv_cache_memory`` per rank) for a model
    of ``dtype``, stored as ``cache_config.kv_cache_dtype`` says. ``extra_bytes_per_block``:
    another cache addressed by the same blocks (a draft model's) shares the budget.
    ``usable_blocks``: the most the scheduler's sequences can hold at once, the cap of an
    automatic CPU budget (``kv_cache_memory=None``)."""
    if cache_config.num_gpu_blocks_override is not None:
        return cache_config.num_gpu_blocks_override
    kv_dtype = kv_cache_torch_dtype(cache_config.kv_cache_dtype, dtype)
    per_block = bytes_per_block(arch, cache_config.block_size, kv_dtype, tp_size)
    per_block += extra_bytes_per_block
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * cache_config.gpu_memory_utilization)
        budget -= torch.cuda.memory_allocated(device) + _CUDA_ACTIVATION_RESERVE
        flag = "--gpu-memory-utilization"
    else:
        budget = cache_config.kv_cache_memory or DEFAULT_CPU_KV_BYTES
        flag = "--kv-cache-memory"
    num_blocks = budget // per_block
    automatic = device.type != "cuda" and cache_config.kv_cache_memory is None
    if automatic and usable_blocks is not None:
        num_blocks = min(num_blocks, max(2, usable_blocks))
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
    layers: list[LayerKVCache]
    dtype: torch.dtype  # storage: the model dtype, or float8_e4m3fn
    # float32 [num_layers, 2, 1]: (K, V) scales of an fp8 cache, viewed by ``layers``; else None
    scales: torch.Tensor | None

    def set_scales(self, k_scales: Sequence[float], v_scales: Sequence[float]) -> None:
        """Write an fp8 cache's per-layer scales in place (captured CUDA graphs see them).

        Only before any K/V is stored: entries already in the cache were divided by the old
        scales.
        """
        if self.scales is None:
            raise ValueError("KV cache scales need --kv-cache-dtype fp8")
        num_layers = self.scales.shape[0]
        values = torch.tensor([list(k_scales), list(v_scales)], dtype=torch.float32)
        if values.shape != (2, num_layers):
            raise ValueError(f"expected {num_layers} K and {num_layers} V scales")
        if not bool(torch.isfinite(values).all() and (values > 0).all()):
            raise ValueError("KV cache scales must be finite and positive")
        self.scales.copy_(values.t().unsqueeze(-1))

    @staticmethod
    def allocate(
        arch: ModelArch,
        cache_config: CacheConfig,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int | None = None,
        tp_size: int = 1,
        extra_bytes_per_block: int = 0,
        usable_blocks: int | None = None,
    ) -> KVCache:
        """This rank's cache for a model of ``dtype``. ``num_blocks``: a count already sized for
        this device (CUDA profiling, or the minimum over TP ranks); else sized here, sharing
        the budget with ``extra_bytes_per_block`` of another cache (``num_blocks_for``)."""
        if num_blocks is None:
            num_blocks = num_blocks_for(
                arch, cache_config, device, dtype, tp_size, extra_bytes_per_block, usable_blocks
            )
        shape = (
            arch.num_hidden_layers,
            arch.kv_cache_parts,
            num_blocks,
            cache_config.block_size,
            arch.num_local_kv_heads(tp_size),
            arch.head_dim,
        )
        kv_dtype = kv_cache_torch_dtype(cache_config.kv_cache_dtype, dtype)
        # Zeroed: masked-out slots are multiplied by 0 in attention, and 0 * NaN garbage = NaN.
        storage = torch.zeros(shape, dtype=kv_dtype, device=device)
        scales = None
        if kv_dtype == FP8_KV_DTYPE:
            scales = torch.ones((arch.num_hidden_layers, 2, 1), dtype=torch.float32, device=device)
        last = arch.kv_cache_parts - 1  # MLA: K and V are the one latent cache
        layers = [
            LayerKVCache(
                storage[i, 0],
                storage[i, last],
                None if scales is None else scales[i, 0],
                None if scales is None else scales[i, 1],
            )
            for i in range(arch.num_hidden_layers)
        ]
        return KVCache(num_blocks, cache_config.block_size, layers, kv_dtype, scales)
