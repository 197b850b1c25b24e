"""Triton fused MoE (vLLM's scheme): tokens sorted by expert, two grouped GEMMs.

1. ``align_block_size`` (torch, no host sync): the ``T * k`` (token, slot) assignments are
   sorted by expert and each expert's run padded to a multiple of ``BLOCK_M`` with a sentinel
   (``T * k``); ``block_experts[b]`` is the expert of row block ``b`` (-1 past the end). The
   buffers have a fixed size, ``T * k + E * (BLOCK_M - 1)`` rows, so the launch shape depends
   on ``T`` only (CUDA-graph friendly).
2. ``_gate_up_kernel``: per row block of one expert, ``act(x @ W_gate.T) * (x @ W_up.T)``
   with both tiles accumulated side by side (float32) and the activation fused into the
   epilogue; writes the ``[T * k, I]`` intermediate (model dtype).
3. ``_down_kernel``: ``intermediate @ W_down.T`` times the assignment's routing weight
   (float32), written per assignment ``[T * k, H]``; the ``k`` rows of a token are then
   summed in float32 and rounded once to the model dtype.

Llama 4 (``scale_input``): each assignment's input row is ``w * x`` (made once on the host,
``[T * k, H]``, in the model dtype as the reference rounds it), the gate/up GEMM reads it per
assignment and the down GEMM's routing weight is 1.

gpt-oss: per-expert biases (``HAS_BIAS``: gate_up [E, 2I] added to both float32 tiles
before the activation; down [E, H], ``None`` on tensor-parallel ranks other than 0, added
before the routing weight) and ``swigluoai`` (``ACT == 2``: the clamped SwiGLU of
``kernels.moe.swiglu_oai_and_mul_ref``, gate half then up half, ``alpha``/``limit`` as
constexprs), all in the epilogues.

Every output element has one writer (no atomics): the result is deterministic. float32 dots
are IEEE (``input_precision="ieee"``), so the interpreter and CUDA float32 runs match the
torch reference to rounding; bf16/fp16 use tensor cores with float32 accumulation. Tile sizes
follow ``T * k / E`` (rows per expert) and are common choices, not tuned on a GPU yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenwire.kernels.moe import MoEBiases, check_moe_shapes
from tokenwire.kernels.triton_compat import patch_interpreter_scalar_index

patch_interpreter_scalar_index()

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "swigluoai": 2}


@dataclass(frozen=True)
class MoETiles:
    """Tile sizes of both GEMMs: ``block_m`` assignment rows x ``block_n`` output columns,
    ``block_k`` deep. Each a power of two >= 16."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2


def default_tiles(num_assignments: int, num_experts: int) -> MoETiles:
    """Tiles from the mean rows per expert: decode-sized steps keep BLOCK_M at the minimum
    so little of each padded block is wasted."""
    per_expert = num_assignments / max(1, num_experts)
    if per_expert <= 16:
        return MoETiles(16, 64, 128)
    if per_expert <= 64:
        return MoETiles(32, 64, 64)
    return MoETiles(64, 128, 64, num_warps=8, num_stages=3)


def align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted assignment ids [R], expert of each row block [R / block_m]).

    ``R = T * k + E * (block_m - 1)`` rounded up to a multiple of ``block_m``: each expert's
    assignments (in token order) start a new block; padding rows hold the sentinel ``T * k``
    and blocks past the last expert's hold expert -1. Torch ops only, no host sync.
    """
    flat = topk_ids.flatten()
    n = flat.numel()
    device = flat.device
    rows = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_end = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    padded_start = padded_end - (counts + block_m - 1) // block_m * block_m
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in sorted order
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(n, device=device) - first[expert_of]
    sorted_ids = torch.full((rows,), n, dtype=torch.int32, device=device)
    sorted_ids[padded_start[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, rows, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_ids, block_experts.to(torch.int32)


@triton.jit
def _act_and_mul(  # type: ignore[no-untyped-def]
    gate, up, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr
):
    """``act(gate) * up`` in float32: SiLU (0), tanh-GELU (1) or gpt-oss's clamped SwiGLU (2):
    ``(clamp(up, -LIMIT, LIMIT) + 1) * g * sigmoid(ALPHA * g)``, ``g = min(gate, LIMIT)``."""
    if ACT == 0:
        out = gate / (1.0 + tl.exp(-gate)) * up
    elif ACT == 1:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        t = tl.exp(-2.0 * tl.abs(inner))  # tanh from exp(-2|y|) <= 1: no overflow
        tanh_abs = (1.0 - t) / (1.0 + t)
        out = 0.5 * gate * (1.0 + tl.where(inner >= 0, tanh_abs, -tanh_abs)) * up
    else:
        g = tl.minimum(gate, LIMIT)
        u = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        out = (u + 1.0) * (g / (1.0 + tl.exp(-ALPHA * g)))
    return out


@triton.jit
def _store_gate_up(  # type: ignore[no-untyped-def]
    acc_gate, acc_up, bias_ptr, expert, N, offs_n, n_mask, ids, m_mask, out_ptr, stride_om,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """The gate/up GEMM's epilogue (shared with ``moe_mxfp4_triton``): the expert's gate and
    up biases, ``act(gate) * up``, stored at the assignments' rows."""
    if HAS_BIAS:
        bias_row = bias_ptr + expert * 2 * N + offs_n
        acc_gate += tl.load(bias_row, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias_row + N, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    act = _act_and_mul(acc_gate, acc_up, ACT, ALPHA, LIMIT)
    ptrs = out_ptr + ids[:, None] * stride_om + offs_n[None, :]
    tl.store(ptrs, act.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _store_down(  # type: ignore[no-untyped-def]
    acc, bias_ptr, expert, N, offs_n, n_mask, weights_ptr, ids, m_mask, out_ptr, stride_om,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """The down GEMM's epilogue (shared with ``moe_mxfp4_triton``): the expert's bias, then
    the assignment's routing weight, stored at its row."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * N + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    scale = tl.load(weights_ptr + ids, mask=m_mask, other=0.0)
    acc = acc * scale[:, None]
    ptrs = out_ptr + ids[:, None] * stride_om + offs_n[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gate_up_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [T, K]
    w_ptr,  # [E, 2N, K]: gate rows, then up rows
    out_ptr,  # [T * k, N]
    bias_ptr,  # [E, 2N], contiguous: read only when HAS_BIAS
    sorted_ptr,  # int32 [R]
    experts_ptr,  # int32 [R / BLOCK_M]
    num_valid,  # T * k
    top_k,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
    ALPHA: tl.constexpr = 0.0,
    LIMIT: tl.constexpr = 0.0,
):
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
    gate_cols = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    up_cols = gate_cols + N * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_rows + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0
        ).to(DOT_DTYPE)
        w_mask = k_mask[:, None] & n_mask[None, :]
        gate = tl.load(gate_cols + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
        up = tl.load(up_cols + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc_gate += tl.dot(x, gate.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        acc_up += tl.dot(x, up.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    _store_gate_up(
        acc_gate, acc_up, bias_ptr, expert, N, offs_n, n_mask, ids, m_mask, out_ptr, stride_om,
        HAS_BIAS, ACT, ALPHA, LIMIT,
    )  # fmt: skip


@triton.jit
def _down_kernel(  # type: ignore[no-untyped-def]
    a_ptr,  # [T * k, K]: the activated intermediate, one row per assignment
    w_ptr,  # [E, N, K]
    out_ptr,  # [T * k, N]
    bias_ptr,  # [E, N], contiguous: read only when HAS_BIAS
    weights_ptr,  # float32 [T * k]: routing weight of each assignment
    sorted_ptr,  # int32 [R]
    experts_ptr,  # int32 [R / BLOCK_M]
    num_valid,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
):
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
    w_cols = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(
            w_cols + offs_k[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0
        )
        acc += tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    _store_down(
        acc, bias_ptr, expert, N, offs_n, n_mask, weights_ptr, ids, m_mask, out_ptr, stride_om,
        HAS_BIAS,
    )  # fmt: skip


def fused_moe_triton(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    *,
    tiles: MoETiles | None = None,
    scale_input: bool = False,
    biases: MoEBiases | None = None,
    swiglu: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.moe.fused_moe_ref`` (float32 accumulation; the k expert
    outputs of a token are summed in float32). ``tiles``: override the tile sizes (tests use
    small tiles under the interpreter). ``scale_input``: Llama 4's input-scaled experts.
    ``biases`` / ``swiglu``: gpt-oss's expert biases and ``swigluoai``'s (alpha, limit)."""
    check_moe_shapes(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    if activation == "swigluoai" and swiglu is None:
        raise ValueError("the swigluoai activation needs swiglu=(alpha, limit)")
    b13, b2 = _check_biases(biases, w_gate_up)
    t, h = hidden.shape
    e, two_i, _ = w_gate_up.shape
    inter, k = two_i // 2, topk_ids.shape[1]
    if t == 0 or inter == 0:
        return torch.zeros_like(hidden)
    n = t * k
    tiles = tiles or default_tiles(n, e)
    sorted_ids, block_experts = align_block_size(topk_ids, e, tiles.block_m)
    dot_dtype = _TL_DTYPES[w_gate_up.dtype]
    precision = "ieee" if w_gate_up.dtype == torch.float32 else None
    blocks = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k)
    launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    m_blocks = block_experts.shape[0]
    activated = torch.empty((n, inter), dtype=hidden.dtype, device=hidden.device)
    x, x_top_k = hidden, k
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    if scale_input:  # one input row per assignment, the weight applied to it
        x = (hidden[:, None, :] * topk_weights[:, :, None].to(hidden.dtype)).reshape(n, h)
        x_top_k, weights = 1, torch.ones_like(weights)
    _gate_up_kernel[(m_blocks * triton.cdiv(inter, tiles.block_n),)](
        x, w_gate_up, activated, w_gate_up if b13 is None else b13, sorted_ids, block_experts,
        n, x_top_k, inter, h,
        x.stride(0), x.stride(1), *w_gate_up.stride(), activated.stride(0),
        ACT=_ACTIVATIONS[activation], DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
        HAS_BIAS=b13 is not None, ALPHA=swiglu[0] if swiglu else 0.0,
        LIMIT=swiglu[1] if swiglu else 0.0, **blocks, **launch,
    )  # fmt: skip
    per_slot = torch.empty((n, h), dtype=hidden.dtype, device=hidden.device)
    _down_kernel[(m_blocks * triton.cdiv(h, tiles.block_n),)](
        activated, w_down, per_slot, w_down if b2 is None else b2, weights, sorted_ids,
        block_experts, n, h, inter,
        activated.stride(0), *w_down.stride(), per_slot.stride(0),
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, HAS_BIAS=b2 is not None,
        **blocks, **launch,
    )  # fmt: skip
    if k == 1:
        return per_slot
    return per_slot.view(t, k, h).sum(dim=1, dtype=torch.float32).to(hidden.dtype)


def _check_biases(
    biases: MoEBiases | None, w_gate_up: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Contiguous (gate_up [E, 2I], down [E, H] or None) biases, or (None, None)."""
    if biases is None:
        return None, None
    b13, b2 = biases
    e, two_i, h = w_gate_up.shape
    if tuple(b13.shape) != (e, two_i) or (b2 is not None and tuple(b2.shape) != (e, h)):
        down = None if b2 is None else tuple(b2.shape)
        raise ValueError(
            f"fused_moe biases must be gate_up [{e}, {two_i}] and down [{e}, {h}]: got "
            f"{tuple(b13.shape)} and {down}"
        )
    return b13.contiguous(), None if b2 is None else b2.contiguous()
