"""Triton fused MoE over MXFP4 expert weights (gpt-oss), de-quantized per tile in registers.

The scheme of ``moe_triton`` (tokens sorted by expert, a gate/up GEMM with the activation in
its epilogue, a down GEMM times the routing weight, the ``k`` rows of a token summed in
float32), with the expert matrices kept in the checkpoint's MXFP4 layout
(``runtime/models/mxfp4.py``): ``w13`` = (blocks uint8 ``[E, 2I, H/32, 16]``, scales uint8
``[E, 2I, H/32]``), gate rows then up rows, and ``w2`` = (``[E, H, I/32, 16]``,
``[E, H, I/32]``). Each K-tile of weights is read as bytes (each byte twice: once for its
even element, the low nibble, once for its odd one, the high nibble), each nibble decoded
from its bits (sign, two exponent bits, one mantissa bit) into a float32 and multiplied by
its block's ``2 ** (scale - 127)`` (built from the exponent bits; scale 0 is the subnormal
``2 ** -127``). Every product is exact in float32 and in bfloat16 (``mxfp4.py``'s doc), so
the tile fed to ``tl.dot`` in the model dtype is the de-quantized weight bit for bit and the
result equals ``fused_moe_ref`` over ``dequantize_mxfp4`` weights up to the order of the
float32 sums. float16 rounds as the de-quantized copy into a float16 model does. Scales of
255 (E8M0 NaN) and overflowing blocks are the loader's to refuse (the de-quantizer's checks).

``K`` (``H`` for gate/up, ``I`` for down) must be a multiple of 32, ``BLOCK_K`` too. Biases,
``swigluoai``, routing and the epilogues are ``moe_triton``'s. Not yet run on a GPU: on
CUDA, denormal handling of the scale products under scales 0..2 is unverified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenwire.kernels.moe import MoEBiases, MXFP4Weight
from tokenwire.kernels.moe_triton import (
    _ACTIVATIONS,
    _TL_DTYPES,
    MoETiles,
    _check_biases,
    _store_down,
    _store_gate_up,
    align_block_size,
    default_tiles,
)

MXFP4_BLOCK = 32


@triton.jit
def _mxfp4_tile(  # type: ignore[no-untyped-def]
    bytes_ptr, scales_ptr, offs_k, offs_n, stride_bn, stride_sn, mask
):
    """float32 ``[BLOCK_K, BLOCK_N]``: weight ``[n, k]`` of the expert whose byte rows start
    at ``bytes_ptr`` (``stride_bn`` bytes per output row) and scale rows at ``scales_ptr``."""
    byte = tl.load(
        bytes_ptr + offs_n[None, :] * stride_bn + (offs_k // 2)[:, None], mask=mask, other=0
    ).to(tl.int32)
    code = (byte >> ((offs_k % 2) * 4)[:, None]) & 0xF
    exp = (code >> 1) & 3
    man = code & 1
    # E2M1 -> float32 bits: exponent e > 0 is 2 ** (e - 1) * (1 + m / 2); e == 0 is m / 2.
    normal = ((exp + 126) << 23) | (man << 22)
    bits = tl.where(exp == 0, man * (126 << 23), normal) | ((code >> 3) << 31)
    value = bits.to(tl.float32, bitcast=True)
    scale = tl.load(
        scales_ptr + offs_n[None, :] * stride_sn + (offs_k // 32)[:, None], mask=mask, other=127
    ).to(tl.int32)
    scale_bits = tl.where(scale == 0, 1 << 22, scale << 23)
    return value * scale_bits.to(tl.float32, bitcast=True)


@triton.jit
def _gate_up_mxfp4_kernel(  # type: ignore[no-untyped-def]
    x_ptr, bytes_ptr, scales_ptr, out_ptr, bias_ptr, sorted_ptr, experts_ptr,
    num_valid, top_k, N, K, stride_xm, stride_be, stride_bn, stride_se, stride_sn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr = False,
    ALPHA: tl.constexpr = 0.0, LIMIT: tl.constexpr = 0.0, INTERLEAVED: tl.constexpr = False,
):  # fmt: skip
    """``moe_triton._gate_up_kernel`` with the weight tiles de-quantized from MXFP4;
    ``INTERLEAVED``: gate row ``n`` is stored row ``2n``, up row ``n`` row ``2n + 1``."""
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // n_blocks
    pid_n = tl.program_id(0) % n_blocks
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a block past the last expert's rows
        return
    ids = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_mask = ids < num_valid
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    x_rows = x_ptr + (ids // top_k)[:, None] * stride_xm
    w_bytes = bytes_ptr + expert * stride_be
    w_scales = scales_ptr + expert * stride_se
    if INTERLEAVED:  # the checkpoint's rows: gate, up, gate, up, ...
        gate_rows = 2 * offs_n
        up_rows = gate_rows + 1
    else:
        gate_rows = offs_n
        up_rows = offs_n + N
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        gate = _mxfp4_tile(w_bytes, w_scales, offs_k, gate_rows, stride_bn, stride_sn, w_mask)
        up = _mxfp4_tile(w_bytes, w_scales, offs_k, up_rows, stride_bn, stride_sn, w_mask)
        x = x.to(DOT_DTYPE)
        acc_gate += tl.dot(x, gate.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        acc_up += tl.dot(x, up.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    _store_gate_up(
        acc_gate, acc_up, bias_ptr, expert, N, offs_n, n_mask, ids, m_mask, out_ptr, stride_om,
        HAS_BIAS, ACT, ALPHA, LIMIT,
    )  # fmt: skip


@triton.jit
def _down_mxfp4_kernel(  # type: ignore[no-untyped-def]
    a_ptr, bytes_ptr, scales_ptr, out_ptr, bias_ptr, weights_ptr, sorted_ptr, experts_ptr,
    num_valid, N, K, stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr = False,
):  # fmt: skip
    """``moe_triton._down_kernel`` with the weight tiles de-quantized from MXFP4."""
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // n_blocks
    pid_n = tl.program_id(0) % n_blocks
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    ids = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_mask = ids < num_valid
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    a_rows = a_ptr + ids[:, None] * stride_am
    w_bytes = bytes_ptr + expert * stride_be
    w_scales = scales_ptr + expert * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w = _mxfp4_tile(w_bytes, w_scales, offs_k, offs_n, stride_bn, stride_sn, w_mask)
        acc += tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    _store_down(
        acc, bias_ptr, expert, N, offs_n, n_mask, weights_ptr, ids, m_mask, out_ptr, stride_om,
        HAS_BIAS,
    )  # fmt: skip


def _flat_pair(
    weight: MXFP4Weight, name: str, experts: int, rows: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes ``[E, rows, k / 2]``, scales ``[E, rows, k / 32]``), contiguous; ValueError on
    another shape or dtype."""
    blocks, scales = weight
    want = (experts, rows, k // MXFP4_BLOCK)
    if (
        blocks.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or tuple(blocks.shape) != (*want, MXFP4_BLOCK // 2)
        or tuple(scales.shape) != want
    ):
        raise ValueError(
            f"MXFP4 {name} must be uint8 blocks {(*want, MXFP4_BLOCK // 2)} and scales {want}: "
            f"got {blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}"
        )
    return blocks.contiguous().view(experts, rows, -1), scales.contiguous()


def _check_operands(
    hidden: torch.Tensor, w13: MXFP4Weight, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> tuple[int, int]:
    """(experts, intermediate size I) of the MXFP4 experts; ValueError when they do not fit."""
    t, h = hidden.shape
    e, two_i = w13[1].shape[0], w13[1].shape[1]
    if h % MXFP4_BLOCK or two_i % (2 * MXFP4_BLOCK) or w13[1].dim() != 3:
        raise ValueError(
            f"MXFP4 experts need hidden and intermediate sizes that are multiples of "
            f"{MXFP4_BLOCK}: hidden {h}, gate_up scales {tuple(w13[1].shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [T={t}, k]"
        )
    return e, two_i // 2


def fused_moe_mxfp4_triton(
    hidden: torch.Tensor,
    w13: MXFP4Weight,
    w2: MXFP4Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    *,
    tiles: MoETiles | None = None,
    biases: MoEBiases | None = None,
    swiglu: tuple[float, float] | None = None,
    interleaved: bool = False,
) -> torch.Tensor:
    """``fused_moe_triton`` with ``w13`` = MXFP4 (blocks ``[E, 2I, H/32, 16]``, scales
    ``[E, 2I, H/32]``) and ``w2`` = (``[E, H, I/32, 16]``, ``[E, H, I/32]``); equals
    ``fused_moe_ref`` over ``dequantize_mxfp4`` of both (float32 accumulation). ``tiles``:
    ``block_k`` must be a multiple of 32 (default tiles are). ``interleaved``: ``w13``'s rows
    are the checkpoint's gate, up, gate, up, ... (the biases stay gate half, then up half)."""
    e, inter = _check_operands(hidden, w13, topk_ids, topk_weights)
    t, h = hidden.shape
    b13_bytes, b13_scales = _flat_pair(w13, "gate_up", e, 2 * inter, h)
    b2_bytes, b2_scales = _flat_pair(w2, "down", e, h, inter)
    if activation == "swigluoai" and swiglu is None:
        raise ValueError("the swigluoai activation needs swiglu=(alpha, limit)")
    b13, b2 = _check_biases(biases, torch.empty((e, 2 * inter, h), device="meta"))
    k = topk_ids.shape[1]
    if t == 0:
        return torch.zeros_like(hidden)
    n = t * k
    tiles = tiles or default_tiles(n, e)
    if tiles.block_k % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 tiles need block_k a multiple of {MXFP4_BLOCK}: {tiles}")
    sorted_ids, block_experts = align_block_size(topk_ids, e, tiles.block_m)
    dot_dtype = _TL_DTYPES[hidden.dtype]
    precision = "ieee" if hidden.dtype == torch.float32 else None
    blocks = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k)
    launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    m_blocks = block_experts.shape[0]
    x = hidden.contiguous()
    activated = torch.empty((n, inter), dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _gate_up_mxfp4_kernel[(m_blocks * triton.cdiv(inter, tiles.block_n),)](
        x, b13_bytes, b13_scales, activated, b13_bytes if b13 is None else b13, sorted_ids,
        block_experts, n, k, inter, h, x.stride(0), b13_bytes.stride(0), b13_bytes.stride(1),
        b13_scales.stride(0), b13_scales.stride(1), activated.stride(0),
        ACT=_ACTIVATIONS[activation], DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
        HAS_BIAS=b13 is not None, ALPHA=swiglu[0] if swiglu else 0.0,
        LIMIT=swiglu[1] if swiglu else 0.0, INTERLEAVED=interleaved, **blocks, **launch,
    )  # fmt: skip
    per_slot = torch.empty((n, h), dtype=hidden.dtype, device=hidden.device)
    _down_mxfp4_kernel[(m_blocks * triton.cdiv(h, tiles.block_n),)](
        activated, b2_bytes, b2_scales, per_slot, b2_bytes if b2 is None else b2, weights,
        sorted_ids, block_experts, n, h, inter, activated.stride(0), b2_bytes.stride(0),
        b2_bytes.stride(1), b2_scales.stride(0), b2_scales.stride(1), per_slot.stride(0),
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, HAS_BIAS=b2 is not None,
        **blocks, **launch,
    )  # fmt: skip
    if k == 1:
        return per_slot
    return per_slot.view(t, k, h).sum(dim=1, dtype=torch.float32).to(hidden.dtype)
