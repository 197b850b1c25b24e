"""Triton weight-only quantized GEMMs: ``y = x @ W.T (+ bias)`` with int4 or int8 ``W``.

Both kernels dequantize a ``[K, BLOCK_N]`` weight tile in registers (float32 arithmetic, then
the activation dtype), ``tl.dot`` it with the matching ``x`` tile and accumulate in float32.
Grid ``(M tiles, N tiles, K splits)``: split-K gives a decode GEMV (M = 1, small N) enough
programs to fill the GPU. Each split writes its own float32 partial ``[M, N]`` and torch sums
them (deterministic: no atomics); one split stores straight into the output dtype.

int4 (``_w4a16_kernel``, canonical GPTQ layout ``qweight int32 [K // 8, N]``): a K tile of
``BLOCK_K`` rows is ``BLOCK_K // 8`` packed rows, loaded once. Nibble ``j`` of those words holds
input rows ``k0 + 8r + j``, so the tile is consumed as 8 dots of depth ``BLOCK_K // 8``, each
against the ``x`` columns ``k0 + j, k0 + 8 + j, ...`` (strided loads of the small activation
tile; no reshape or repeated weight loads). Scales/zeros: one row per tile when the tile lies
inside one group (``BLOCK_GROUPED``), else gathered per input row from ``g_idx`` (act-order)
or ``k // group_size`` (groups smaller than the tile).

int8 (``_w8a16_kernel``, ``qweight int8 [N, K]``, ``scales [N, G]``): codes are exact in
bf16/fp16, so with one group per tile the scale multiplies the dot's float32 result.

Tile sizes are fixed per M bucket (no autotuning: the launch must be CUDA-graph safe and
deterministic); they are common Hopper choices, not yet tuned on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenwire.kernels.triton_compat import patch_interpreter_scalar_index

patch_interpreter_scalar_index()

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _store_tile(  # type: ignore[no-untyped-def]
    acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_split, HAS_BIAS: tl.constexpr
):
    """Add the bias (first split only) and store this split's ``[BLOCK_M, BLOCK_N]`` tile."""
    pid_s = tl.program_id(2)
    n_mask = offs_n < N
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += tl.where(pid_s == 0, bias, 0.0)[None, :]
    ptrs = out_ptr + pid_s * stride_split + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & n_mask[None, :])


@triton.jit
def _w4_tile_scales(  # type: ignore[no-untyped-def]
    s_ptr, z_ptr, k0, offs_n, n_mask, stride_sg, GROUP_SIZE: tl.constexpr
):
    """``(scale, zero)`` ``[1, BLOCK_N]`` float32: the one group of a K tile inside one group."""
    group_off = (k0 // GROUP_SIZE) * stride_sg + offs_n
    scale = tl.load(s_ptr + group_off, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    zero = tl.load(z_ptr + group_off, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    return scale, zero


@triton.jit
def _w4_row_scales(  # type: ignore[no-untyped-def]
    s_ptr, z_ptr, g_idx_ptr, offs_k, offs_n, r_mask, w_mask, stride_sg,
    GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr,
):  # fmt: skip
    """``(scale, zero)`` ``[len(offs_k), BLOCK_N]`` float32: each input row's group, from
    ``g_idx`` (act-order) or ``k // GROUP_SIZE``."""
    group = tl.load(g_idx_ptr + offs_k, mask=r_mask, other=0) if HAS_G_IDX else offs_k // GROUP_SIZE
    group_off = group[:, None] * stride_sg + offs_n[None, :]
    scale = tl.load(s_ptr + group_off, mask=w_mask, other=0.0).to(tl.float32)
    zero = tl.load(z_ptr + group_off, mask=w_mask, other=0.0).to(tl.float32)
    return scale, zero


@triton.jit
def _w4a16_kernel(  # type: ignore[no-untyped-def]
    x_ptr, qw_ptr, s_ptr, z_ptr, g_idx_ptr, bias_ptr, out_ptr, M, N, K, K_PER_SPLIT,
    stride_xm, stride_qk, stride_sg, stride_om, stride_split,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_GROUPED: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """``x [M, K]`` (unit column stride), ``qw int32 [K // 8, N]``, scales and zeros ``[G, N]``,
    ``g_idx int32 [K]`` (read only when ``HAS_G_IDX``), bias ``[N]`` (only when ``HAS_BIAS``),
    out ``[splits, M, N]``; ``K_PER_SPLIT`` is a multiple of ``BLOCK_K``. ``BLOCK_GROUPED``:
    no g_idx and every K tile inside one group."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_K // 8)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = tl.program_id(2) * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rows = k0 // 8 + offs_r
        r_mask = rows < K // 8
        w_mask = r_mask[:, None] & n_mask[None, :]
        packed = tl.load(qw_ptr + rows[:, None] * stride_qk + offs_n[None, :], mask=w_mask, other=0)
        if BLOCK_GROUPED:
            scale, zero = _w4_tile_scales(s_ptr, z_ptr, k0, offs_n, n_mask, stride_sg, GROUP_SIZE)
        for j in tl.static_range(8):
            offs_k = rows * 8 + j
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=m_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            if not BLOCK_GROUPED:
                scale, zero = _w4_row_scales(
                    s_ptr, z_ptr, g_idx_ptr, offs_k, offs_n, r_mask, w_mask, stride_sg,
                    GROUP_SIZE, HAS_G_IDX,
                )  # fmt: skip
            w = (((packed >> (4 * j)) & 0xF).to(tl.float32) - zero) * scale
            acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    _store_tile(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_split, HAS_BIAS)


@triton.jit
def _w8_dequantize(  # type: ignore[no-untyped-def]
    codes, s_ptr, min_ptr, offs_k, offs_n, w_mask, stride_sn, stride_mn,
    GROUP_SIZE: tl.constexpr, MIN_GROUP: tl.constexpr, HAS_MIN: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    """The ``[BLOCK_K, BLOCK_N]`` weight tile ``code * scale (+ min)`` per element (float32
    arithmetic), in ``DOT_DTYPE``: a K tile that spans several groups."""
    s_off = offs_n[None, :] * stride_sn + (offs_k // GROUP_SIZE)[:, None]
    scale = tl.load(s_ptr + s_off, mask=w_mask, other=0.0).to(tl.float32)
    w = codes.to(tl.float32) * scale
    if HAS_MIN:
        m_off = offs_n[None, :] * stride_mn + (offs_k // MIN_GROUP)[:, None]
        w += tl.load(min_ptr + m_off, mask=w_mask, other=0.0).to(tl.float32)
    return w.to(DOT_DTYPE)


@triton.jit
def _w8a16_kernel(  # type: ignore[no-untyped-def]
    x_ptr, qw_ptr, s_ptr, min_ptr, bias_ptr, out_ptr, M, N, K, K_PER_SPLIT,
    stride_xm, stride_qn, stride_sn, stride_mn, stride_om, stride_split,
    GROUP_SIZE: tl.constexpr, MIN_GROUP: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """``x [M, K]``, ``qw int8 [N, K]``, scales ``[N, G]`` and minimums ``[N, K // MIN_GROUP]``
    (read only when ``HAS_MIN``: ``W = code * scale + min``, GGUF K-quants; never
    ``BLOCK_GROUPED``), all with unit column stride; bias ``[N]`` (only when ``HAS_BIAS``), out
    ``[splits, M, N]``; ``K_PER_SPLIT`` is a multiple of ``BLOCK_K``. ``BLOCK_GROUPED``: every
    K tile inside one group."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = tl.program_id(2) * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        w_mask = k_mask[:, None] & n_mask[None, :]
        codes = tl.load(
            qw_ptr + offs_n[None, :] * stride_qn + offs_k[:, None], mask=w_mask, other=0
        )
        if BLOCK_GROUPED:
            scale = tl.load(s_ptr + offs_n * stride_sn + k0 // GROUP_SIZE, mask=n_mask, other=0.0)
            part = tl.dot(x, codes.to(DOT_DTYPE), input_precision=DOT_PRECISION)
            acc += part * scale.to(tl.float32)[None, :]
        else:
            w = _w8_dequantize(
                codes, s_ptr, min_ptr, offs_k, offs_n, w_mask, stride_sn, stride_mn,
                GROUP_SIZE, MIN_GROUP, HAS_MIN, DOT_DTYPE,
            )  # fmt: skip
            acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    _store_tile(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_split, HAS_BIAS)


@dataclass(frozen=True)
class Tiles:
    """One launch's tile sizes; ``split_k`` None = enough K splits to fill the GPU."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 3


def default_tiles(m: int) -> Tiles:
    """Tiles per M bucket: a decode-sized M keeps BLOCK_M at the MMA minimum of 16."""
    if m <= 16:
        return Tiles(16, 64, 128)
    if m <= 64:
        return Tiles(64, 64, 128)
    return Tiles(128, 128, 128, num_warps=8)


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _k_per_split(m: int, n: int, k: int, tiles: Tiles, device: torch.device) -> tuple[int, int]:
    """``(K rows per split, number of splits)``: about two programs per SM on CUDA."""
    k_tiles = triton.cdiv(k, tiles.block_k)
    splits = tiles.split_k
    if splits is None:
        splits = 1
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            programs = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
            splits = max(1, triton.cdiv(2 * _sm_count(index), programs))
    tiles_per_split = triton.cdiv(k_tiles, max(1, min(splits, k_tiles)))
    return tiles_per_split * tiles.block_k, triton.cdiv(k_tiles, tiles_per_split)


def _launch_setup(
    x: torch.Tensor, n: int, tiles: Tiles | None, compute_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, Tiles, int, dict[str, object]]:
    """Common wrapper work: ``(x, out buffer, tiles, K per split, shared constexprs)``."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    tiles = tiles or default_tiles(m)
    k_per_split, splits = _k_per_split(m, n, k, tiles, x.device)
    out_dtype = x.dtype if splits == 1 else torch.float32
    out = torch.empty((splits, m, n), dtype=out_dtype, device=x.device)
    dot_dtype = compute_dtype or x.dtype
    meta: dict[str, object] = {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "DOT_DTYPE": _TL_DTYPES[dot_dtype],
        "DOT_PRECISION": "ieee" if dot_dtype == torch.float32 else None,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
    }
    return x, out, tiles, k_per_split, meta


def _finish(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return out[0] if out.shape[0] == 1 else out.sum(0).to(dtype)


def _grid(m: int, n: int, out: torch.Tensor, tiles: Tiles) -> tuple[int, int, int]:
    return (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), out.shape[0])


def w4a16_matmul_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias) -> [M, N]`` in ``x.dtype``; ``W`` in the canonical int4 layout.

    ``compute_dtype``: the dot's input dtype (default ``x.dtype``); float32 dots are IEEE.
    ``tiles``: override the tile sizes (tests use small tiles under the interpreter).
    """
    m, k = x.shape
    n = qweight.shape[1]
    if m == 0:
        return x.new_empty((0, n))
    qweight, scales, zeros = (
        t if t.is_contiguous() else t.contiguous() for t in (qweight, scales, zeros)
    )
    x, out, tiles, k_per_split, meta = _launch_setup(x, n, tiles, compute_dtype)
    if tiles.block_k % 8 or tiles.block_k < 8:
        raise ValueError(f"w4a16: block_k must be a multiple of 8, got {tiles.block_k}")
    grouped = g_idx is None and (group_size % tiles.block_k == 0 or group_size >= k)
    _w4a16_kernel[_grid(m, n, out, tiles)](
        x, qweight, scales, zeros,
        x if g_idx is None else g_idx,  # any pointer: never read without g_idx
        x if bias is None else bias,
        out, m, n, k, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(1), out.stride(0),
        GROUP_SIZE=group_size,
        HAS_G_IDX=g_idx is not None,
        BLOCK_GROUPED=grouped,
        HAS_BIAS=bias is not None,
        **meta,
    )  # fmt: skip
    return _finish(out, x.dtype)


def w8a16_matmul_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    mins: torch.Tensor | None = None,
    min_group: int = 32,
    compute_dtype: torch.dtype | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias) -> [M, N]`` in ``x.dtype``; ``W`` in the canonical int8 layout
    (``mins`` ``[N, K // min_group]``: ``W = code * scale + min``, GGUF's K-quant form)."""
    m, k = x.shape
    n = qweight.shape[0]
    if m == 0:
        return x.new_empty((0, n))
    qweight, scales = (t if t.is_contiguous() else t.contiguous() for t in (qweight, scales))
    mins = None if mins is None else mins.contiguous()
    x, out, tiles, k_per_split, meta = _launch_setup(x, n, tiles, compute_dtype)
    grouped = mins is None and (group_size % tiles.block_k == 0 or group_size >= k)
    _w8a16_kernel[_grid(m, n, out, tiles)](
        x, qweight, scales,
        scales if mins is None else mins,
        x if bias is None else bias,
        out, m, n, k, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0),
        0 if mins is None else mins.stride(0), out.stride(1), out.stride(0),
        GROUP_SIZE=group_size,
        MIN_GROUP=min_group,
        HAS_MIN=mins is not None,
        BLOCK_GROUPED=grouped,
        HAS_BIAS=bias is not None,
        **meta,
    )  # fmt: skip
    return _finish(out, x.dtype)
