"""Triton rotary embedding (HF ``rotate_half`` / neox layout), one program per token.

Grid ``(num_tokens,)``: a program reads its position's cos/sin row from ``cos_sin_cache``
(``[max_position, head_dim]``, cos half then sin half — the layout ``build_cos_sin_cache``
writes, so Llama-3/linear scaling is already folded in) and rotates every query and key head
of the token. Math in float32 with one rounding at the store; outputs are new contiguous
tensors, as the reference returns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenwire.kernels.dispatch import next_power_of_2


@triton.jit
def _rotate_heads(  # type: ignore[no-untyped-def]
    src_ptr,
    dst_ptr,
    stride_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate ``[NUM_HEADS, 2 * HALF]`` at ``src_ptr`` (rows ``stride_h`` apart) into ``dst_ptr``
    (contiguous): ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    src = src_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    dst = dst_ptr + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(dst, out1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, out2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    row = cos_sin_ptr + pos * stride_cache + offs_d
    cos = tl.load(row, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_qt,
        q_out_ptr + token * (NUM_Q_HEADS * 2 * HALF),
        stride_qh,
        cos,
        sin,
        NUM_Q_HEADS,
        HALF,
        BLOCK_QH,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr + token * stride_kt,
        k_out_ptr + token * (NUM_KV_HEADS * 2 * HALF),
        stride_kh,
        cos,
        sin,
        NUM_KV_HEADS,
        HALF,
        BLOCK_KH,
        BLOCK_HALF,
    )


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``apply_rotary_ref``; ``q``/``k`` may be strided over tokens/heads."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    cache = _unit_last_stride(cos_sin_cache)
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        q_out,
        k_out,
        positions,
        cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_QH=next_power_of_2(num_q_heads),
        BLOCK_KH=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(half),
    )
    return q_out, k_out
