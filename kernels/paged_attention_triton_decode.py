"""Triton paged decode attention: split-KV (flash-decoding) with a reduce kernel.

Stage 1, grid ``(num_decodes, num_kv_heads, num_splits)``: a program owns one sequence, one KV
head and one contiguous slice of its context. The query heads sharing that KV head (GQA group,
padded to ``BLOCK_H >= 16`` rows for ``tl.dot``) are packed as the rows of one query tile, so
each K/V tile is loaded once per group. Slice ``i`` covers positions
``[i * L, min((i + 1) * L, seq_len))`` with ``L = cdiv(cdiv(seq_len, num_splits), BLOCK_N) *
BLOCK_N``; a slice past the end is empty and writes ``lse = -inf``. It stores the slice's
normalized output and log2-sum-exp in float32 scratch.

Stage 2, grid ``(num_decodes, num_q_heads)``: merges the slices with weights
``exp2(lse_i - max lse)``. A sequence with ``seq_len == 0`` (CUDA-graph padding row) has only
empty slices and gets zeros. gpt-oss's sink logit (``HAS_SINKS``) is added here, once per
head, as one more term of the denominator (the slices never see it).

The grid depends on the batch size, head counts and ``num_splits`` only, never on context
lengths (which are read on device), so a captured CUDA graph stays valid for any lengths. An
fp8 cache's scales are read on device too (``k_scale`` folds into the score scale, ``v_scale``
into each slice's output), so a graph also stays valid when a scale is rewritten in place.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tokenwire.kernels.dispatch import next_power_of_2
from tokenwire.kernels.kv_quant import is_fp8, unit_scale
from tokenwire.kernels.paged_attention_triton_common import (
    LOG2_E,
    LOG2_E_C,
    NO_WINDOW,
    fold_sink,
    load_k_and_v,
    online_softmax_step,
    store_split_partial,
)

MAX_SPLITS = 16
# Interpreter (CPU) default: several splits, so the split/reduce path is what CPU tests run.
_CPU_SPLITS = 4
_BLOCK_N = 64  # key positions per tile


@triton.jit
def _split_range(  # type: ignore[no-untyped-def]
    seq_len, window, chunk, split, num_splits, BLOCK_N: tl.constexpr
):
    """``[start, end)``: the key positions of slice ``split`` (empty past the last key)."""
    first_key = tl.maximum(seq_len - window, 0)  # the splits share [first_key, seq_len)
    first_key = tl.maximum(first_key, (seq_len - 1) // chunk * chunk)
    split_len = tl.cdiv(tl.cdiv(seq_len - first_key, num_splits), BLOCK_N) * BLOCK_N
    start = first_key + split * split_len
    return start, tl.minimum(start + split_len, seq_len)


@triton.jit
def _load_q_group(  # type: ignore[no-untyped-def]
    q_ptr,
    seq,
    kv_head,
    stride_qt,
    stride_qh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The ``[BLOCK_H, BLOCK_D]`` query tile of ``kv_head``'s GQA group (rows past ``GROUP``
    load zeros) with its heads, row mask, feature offsets and feature mask."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q_ptrs = q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    return q, heads, h_mask, offs_d, d_mask


@triton.jit
def _walk_split(  # type: ignore[no-untyped-def]
    q,
    start,
    end,
    qk_scale,
    k_cache_ptr,
    v_cache_ptr,
    table_row,
    kv_head,
    offs_d,
    d_mask,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    """The online softmax over the slice's keys ``[start, end)``: ``(max, sum, acc)``."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        k, v = load_k_and_v(
            k_cache_ptr, v_cache_ptr, table_row, pos, pos_mask, kv_head, offs_d, d_mask,
            stride_cb, stride_cs, stride_ch, BLOCK_SIZE,
        )  # fmt: skip
        m_i, l_i, acc = online_softmax_step(
            q, k, v, pos_mask[None, :], m_i, l_i, acc, qk_scale, DOT_PRECISION, SOFT_CAP
        )
    return m_i, l_i, acc


@triton.jit
def _decode_split_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    mid_o_ptr,  # float32 [num_decodes, Hq, num_splits, HEAD_DIM], contiguous
    mid_lse_ptr,  # float32 [num_decodes, Hq, num_splits], contiguous
    k_scale_ptr,  # float32 [1]: fp8 cache scales, read only when FP8
    v_scale_ptr,
    qk_scale,
    window,  # keys at positions >= seq_len - window only (a huge value: no window)
    chunk,  # keys of the last query's chunk only (Llama 4; a huge value: no chunks)
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    num_splits = tl.num_programs(2)  # a runtime value: no recompile per split count
    seq_len = tl.load(seq_lens_ptr + seq)
    start, end = _split_range(seq_len, window, chunk, split, num_splits, BLOCK_N)
    q, heads, h_mask, offs_d, d_mask = _load_q_group(
        q_ptr, seq, kv_head, stride_qt, stride_qh, GROUP, HEAD_DIM, BLOCK_H, BLOCK_D
    )
    m_i, l_i, acc = _walk_split(
        q, start, end, qk_scale, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt,
        kv_head, offs_d, d_mask, stride_cb, stride_cs, stride_ch,
        BLOCK_H, BLOCK_D, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, SOFT_CAP,
    )  # fmt: skip
    store_split_partial(
        acc, m_i, l_i, mid_o_ptr, mid_lse_ptr, v_scale_ptr, seq, heads, h_mask, split,
        num_splits, offs_d, d_mask, NUM_Q_HEADS, HEAD_DIM, FP8,
    )  # fmt: skip


@triton.jit
def _decode_reduce_kernel(  # type: ignore[no-untyped-def]
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    sinks_ptr=None,  # [Hq] sink logits (gpt-oss), read only when HAS_SINKS
    HAS_SINKS: tl.constexpr = False,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    row = (seq * NUM_Q_HEADS + head) * num_splits + offs_s
    lse = tl.load(mid_lse_ptr + row, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # 0 for empty
    total = tl.sum(weight, axis=0)
    if HAS_SINKS:  # the sink column joins once, here: total and weights rescaled to its max
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2_E_C
        total, alpha = fold_sink(lse_max, total, sink)
        weight = weight * alpha
    o = tl.load(
        mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    merged = tl.sum(o * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    out_ptrs = out_ptr + seq * stride_ot + head * stride_oh + offs_d
    tl.store(out_ptrs, merged.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def default_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU about twice.

    Depends only on the batch shape, so a CUDA graph captured for a batch-size bucket keeps
    its grid for any context lengths.
    """
    if device.type != "cuda":
        return _CPU_SPLITS
    programs = max(1, num_seqs * num_kv_heads)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, min(MAX_SPLITS, -(-2 * _sm_count(index) // programs)))


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_splits: int,
    block_n: int = _BLOCK_N,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    attention_chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attention for ``num_seqs = seq_lens.shape[0]`` one-token rows ``query[:num_seqs]``.

    ``block_tables``/``seq_lens`` rows are the decode sequences in order; results land in
    ``out[:num_seqs]``. ``num_splits`` must not depend on context lengths (CUDA graphs).
    ``k_scale``/``v_scale``: an fp8 cache's float32 [1] scales (``None`` = 1.0).
    ``logits_soft_cap``: Gemma 2's tanh cap (None: off). ``sliding_window``: only the last
    ``sliding_window`` positions are read (None: all). ``attention_chunk`` (Llama 4): only
    the keys of the last position's chunk, ``[(seq_len - 1) // C * C, seq_len)``.
    ``sinks``: gpt-oss's per-query-head sink logits [Hq] (None: none).
    """
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_q_heads = query.shape[1]
    group = num_q_heads // num_kv_heads
    mid_o = torch.empty(
        (num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
    )
    mid_lse = torch.empty(
        (num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=query.device
    )
    block_d = next_power_of_2(head_dim)
    fp8 = is_fp8(k_cache)
    unit = unit_scale(query.device) if fp8 else mid_lse  # an unquantized cache reads neither
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse,
        unit if k_scale is None else k_scale, unit if v_scale is None else v_scale,
        scale * LOG2_E,
        NO_WINDOW if sliding_window is None else sliding_window,
        NO_WINDOW if attention_chunk is None else attention_chunk,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_H=max(16, next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        FP8=fp8, SOFT_CAP=logits_soft_cap or 0.0, num_warps=4,
    )  # fmt: skip
    _decode_reduce_kernel[(num_seqs, num_q_heads)](
        mid_o, mid_lse, out, num_splits, out.stride(0), out.stride(1),
        NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_S=next_power_of_2(num_splits), sinks_ptr=sinks, HAS_SINKS=sinks is not None,
        num_warps=4,
    )  # fmt: skip
