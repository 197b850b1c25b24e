"""Write this step's K/V rows into the paged KV cache.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``; slot
``block * block_size + offset`` is row ``slot`` of the cache viewed as
``[num_blocks * block_size, num_kv_heads, head_dim]``. Slot ``-1`` marks a padding row
(CUDA-graph padding) that must not be written: block 0 is the null block and stays untouched.

An fp8 cache (``kv_quant``) stores ``key / k_scale`` and ``value / v_scale`` as e4m3, saturated
to +-448; the scales are ignored for any other cache dtype.
"""

from __future__ import annotations

import torch

from tokenwire.kernels.dispatch import use_triton
from tokenwire.kernels.kv_quant import is_fp8, quantize_fp8


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store ``key``/``value`` [T, Hkv, D] at ``slot_mapping[:T]`` (int64, -1 = skip).

    ``k_scale``/``v_scale``: float32 [1] per-tensor scales of an fp8 cache (``None`` = 1.0).
    """
    if use_triton(key):
        from tokenwire.kernels.store_kv_triton import store_kv_triton

        store_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    store_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Torch reference: one ``index_copy_`` per cache; masked write only when padded.

    ``slot_mapping`` may be longer than T (a preallocated buffer); only its first T entries
    are used. The caches must be contiguous so the flat views alias them (``view`` raises
    otherwise instead of silently writing into a copy). An fp8 cache is written through
    ``uint8`` views of the same bytes: torch has no CPU ``index_copy_`` for float8.
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    slots = slot_mapping[:num_tokens]
    k_flat = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    v_flat = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
    if is_fp8(k_cache):
        key = quantize_fp8(key, k_scale).view(torch.uint8)
        value = quantize_fp8(value, v_scale).view(torch.uint8)
        k_flat, v_flat = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
    # One reduction decides the path (a host sync, free on CPU; a Triton kernel skips
    # negative slots per row instead). The unpadded path avoids boolean indexing.
    if bool(slots.min() >= 0):
        k_flat.index_copy_(0, slots, key)
        v_flat.index_copy_(0, slots, value)
        return
    keep = slots >= 0
    k_flat.index_copy_(0, slots[keep], key[keep])
    v_flat.index_copy_(0, slots[keep], value[keep])
