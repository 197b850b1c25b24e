"""Triton segmented multi-LoRA matmul (Punica SGMV / vLLM v1 style): shrink, then expand.

- shrink: ``buf[rows, :R] = x[rows] @ lora_a[slot].T`` (float32 accumulation and storage),
  looping over K in ``BLOCK_K`` tiles;
- expand: ``y[rows] = y[rows] + buf[rows] @ lora_b[slot].T``, looping over R in ``BLOCK_R``
  tiles; the sum is rounded once to ``y``'s dtype on store.

Both grids are ``(cdiv(T, BLOCK_M) * column blocks, max_segments)`` (see ``kernels/lora.py``
for how they cover the runs): the segment table is read on the device and unused programs
return at once, so one captured CUDA graph serves every step of the same ``T``. Runs are
disjoint, so every output element has exactly one writer (no atomics, deterministic).

``R`` is padded with masks to the dot minimum of 16. The expand dot takes ``buf`` rounded to
the weights' dtype (the torch reference rounds the shrink result the same way); float32 dots
are IEEE. Tile sizes follow ``T`` only (never the runs), are common choices and are not tuned
on a GPU yet. No split-K: a decode step with few adapters runs few shrink programs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenwire.kernels.dispatch import next_power_of_2
from tokenwire.kernels.lora import LoRASegments, check_lora_shapes
from tokenwire.kernels.triton_compat import patch_interpreter_scalar_index

patch_interpreter_scalar_index()

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _segment_rows(  # type: ignore[no-untyped-def]
    starts_ptr, slots_ptr, length, pid_m, BLOCK_M: tl.constexpr
):
    """``(rows of y/x, row mask, slot)`` of this program's row block of its segment."""
    seg = tl.program_id(1)
    start = tl.load(starts_ptr + seg).to(tl.int64)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return start + offs, offs < length, slot


@triton.jit
def _shrink_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [T, K]
    a_ptr,  # [S, R, K]
    buf_ptr,  # float32 [T, R], unit column stride
    starts_ptr,  # int32 [max_segments]
    lengths_ptr,  # int32 [max_segments]
    slots_ptr,  # int32 [max_segments]
    R,
    K,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_bufm,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    r_blocks = tl.cdiv(R, BLOCK_R)
    pid_m = tl.program_id(0) // r_blocks
    pid_r = tl.program_id(0) % r_blocks
    length = tl.load(lengths_ptr + tl.program_id(1))
    if pid_m * BLOCK_M >= length:  # unused segment, or a row block past the run's end
        return
    rows, m_mask, slot = _segment_rows(starts_ptr, slots_ptr, length, pid_m, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    x_rows = x_ptr + rows[:, None] * stride_xm
    a_cols = a_ptr + slot * stride_as + offs_r[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_rows + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        a = tl.load(
            a_cols + offs_k[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_R] = lora_a[slot].T tile
        acc += tl.dot(x.to(DOT_DTYPE), a.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    ptrs = buf_ptr + rows[:, None] * stride_bufm + offs_r[None, :]
    tl.store(ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(  # type: ignore[no-untyped-def]
    buf_ptr,  # float32 [T, R], unit column stride
    b_ptr,  # [S, N, R]
    y_ptr,  # [T, N]
    starts_ptr,  # int32 [max_segments]
    lengths_ptr,  # int32 [max_segments]
    slots_ptr,  # int32 [max_segments]
    R,
    N,
    stride_bufm,
    stride_bs,
    stride_bn,
    stride_br,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // n_blocks
    pid_n = tl.program_id(0) % n_blocks
    length = tl.load(lengths_ptr + tl.program_id(1))
    if pid_m * BLOCK_M >= length:  # unused segment, or a row block past the run's end
        return
    rows, m_mask, slot = _segment_rows(starts_ptr, slots_ptr, length, pid_m, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    buf_rows = buf_ptr + rows[:, None] * stride_bufm
    b_cols = b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        h = tl.load(buf_rows + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(
            b_cols + offs_r[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :], other=0.0
        )  # [BLOCK_R, BLOCK_N] = lora_b[slot].T tile
        acc += tl.dot(h.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class LoRATiles:
    """One call's tile sizes (shrink: ``block_m x block_r_shrink`` outputs, ``block_k`` deep;
    expand: ``block_m x block_n`` outputs, ``block_r`` deep). Each is a power of two >= 16."""

    block_m: int
    block_n: int
    block_k: int
    block_r_shrink: int
    block_r: int
    num_warps: int = 4
    num_stages: int = 2


def default_tiles(num_tokens: int, rank: int) -> LoRATiles:
    """Tiles from ``T`` and ``R`` only: a decode-sized step keeps BLOCK_M at the MMA minimum;
    the shrink covers ranks up to 128 in one column block (``x`` is read once)."""
    block_r = min(max(16, next_power_of_2(rank)), 128)
    if num_tokens <= 16:
        return LoRATiles(16, 64, 128, block_r, min(block_r, 64))
    if num_tokens <= 128:
        return LoRATiles(32, 64, 64, block_r, min(block_r, 64))
    return LoRATiles(64, 128, 64, block_r, min(block_r, 64), num_warps=8)


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: LoRASegments,
    *,
    tiles: LoRATiles | None = None,
) -> None:
    """``y[t] += (x[t] @ lora_a[slot].T) @ lora_b[slot].T`` for the segments' tokens, in place.

    Any strides (``y``'s rows and columns, ``x``, the stacked weights) are passed through. The
    launch never reads ``segments.runs``: an empty step still launches (every program returns),
    so it can be captured in a CUDA graph and replayed after ``SegmentBuffers.fill``.
    ``tiles``: override the tile sizes (tests use small tiles under the interpreter).
    """
    check_lora_shapes(y, x, lora_a, lora_b, segments)
    t, n = y.shape
    _, r, k = lora_a.shape
    if t == 0 or r == 0 or n == 0:
        return
    tiles = tiles or default_tiles(t, r)
    dot_dtype = _TL_DTYPES[lora_a.dtype]
    precision = "ieee" if lora_a.dtype == torch.float32 else None
    max_segments = segments.lengths.shape[0]
    table = (segments.starts, segments.lengths, segments.slots)
    m_blocks = triton.cdiv(t, tiles.block_m)
    buf = torch.empty((t, r), dtype=torch.float32, device=y.device)
    warps = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    _shrink_kernel[(m_blocks * triton.cdiv(r, tiles.block_r_shrink), max_segments)](
        x, lora_a, buf, *table, r, k,
        x.stride(0), x.stride(1), *lora_a.stride(), buf.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_R=tiles.block_r_shrink, BLOCK_K=tiles.block_k,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, **warps,
    )  # fmt: skip
    _expand_kernel[(m_blocks * triton.cdiv(n, tiles.block_n), max_segments)](
        buf, lora_b, y, *table, r, n,
        buf.stride(0), *lora_b.stride(), y.stride(0), y.stride(1),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_R=tiles.block_r,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, **warps,
    )  # fmt: skip
