"""Triton ``store_kv``: one program per token row copies its K and V into the paged cache.

Grid ``(num_tokens,)``. A program reads ``slot_mapping[t]``; ``-1`` (CUDA-graph padding) returns
before touching the cache, so the null block is never written and no host sync is needed to
find padding. The ``[Hkv, D]`` tile is padded to powers of two and masked.

An fp8 cache gets ``x / scale`` saturated to +-448 and rounded to nearest even in float32
arithmetic (``_round_to_e4m3``) before the cast, so the cast itself is exact: the stored bytes
equal torch's ``.to(torch.float8_e4m3fn)`` on GPU and under the CPU interpreter alike (the
interpreter's own float-to-fp8 cast rounds ties up and can drop a carry into the exponent).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenwire.kernels.dispatch import next_power_of_2
from tokenwire.kernels.kv_quant import FP8_E4M3_MAX, is_fp8, unit_scale

_E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)
# 1.5 * 2^23: in float32, (y + M) - M rounds |y| < 2^22 to an integer, ties to even.
_RINT_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _round_to_e4m3(x):  # type: ignore[no-untyped-def]
    """float32 ``x`` saturated to +-448 and rounded to its nearest e4m3 value (ties even)."""
    x = tl.minimum(tl.maximum(x, -_E4M3_MAX), _E4M3_MAX)
    # e4m3 keeps 3 mantissa bits: its spacing at x is 2^(e - 3), e = max(exponent(x), -6)
    # (below 2^-6 the spacing stays 2^-9: subnormals). Powers of two are built from bits.
    e = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    inv_ulp = ((127 + 3 - e) << 23).to(tl.float32, bitcast=True)
    ulp = ((127 - 3 + e) << 23).to(tl.float32, bitcast=True)
    return ((x * inv_ulp + _RINT_MAGIC) - _RINT_MAGIC) * ulp


@triton.jit
def _quantize_tile(x, scale_ptr, FP8: tl.constexpr):  # type: ignore[no-untyped-def]
    if FP8:
        x = _round_to_e4m3(tl.div_rn(x.to(tl.float32), tl.load(scale_ptr)))
    return x


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,  # float32 [1], read only when FP8
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,  # cache stride between slots (elements); the cache is contiguous
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    row = token.to(tl.int64)
    src_k = key_ptr + row * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = value_ptr + row * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = _quantize_tile(tl.load(src_k, mask=mask), k_scale_ptr, FP8)
    v = _quantize_tile(tl.load(src_v, mask=mask), v_scale_ptr, FP8)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Same contract as ``store_kv_ref``; ``key``/``value`` may be strided over tokens/heads."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv: k_cache and v_cache must be contiguous")
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    fp8 = is_fp8(k_cache)
    if fp8 and (k_scale is None or v_scale is None):
        k_scale = v_scale = unit_scale(key.device)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if fp8 else key,  # any pointer: an unquantized cache never reads it
        v_scale if fp8 else key,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        FP8=fp8,
    )
