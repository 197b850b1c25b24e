"""Triton paged prefill attention: variable-length causal queries in one launch.

Grid ``(num_prefill_tokens // BLOCK_Q + num_prefills, num_kv_heads)``. A program owns
``BLOCK_Q = BLOCK_M // GROUP`` consecutive query tokens of one sequence times the ``GROUP``
query heads sharing one KV head (row ``m`` is token ``m // GROUP``, head ``m % GROUP``), so
each K/V tile is loaded once per group and non-power-of-two groups waste at most
``BLOCK_M % GROUP`` rows. Query tiles of sequence ``s`` are numbered from
``(query_start_loc[s] - query_start_loc[0]) // BLOCK_Q + s``: these ranges are disjoint and
bounded by the grid size, so a program finds its sequence by binary search on device (no host
sync, no per-step tile map) and programs past a sequence's last tile exit at once.

Queries sit at absolute positions ``seq_len - query_len ..``, so prefix hits and later chunks of
a chunked prefill attend to every cached position before them; keys are read from the paged
cache (``store_kv`` already wrote this step's rows), walking ``[0, last query position]`` in
tiles of ``BLOCK_N`` under the causal mask (from the tile's first query's window start when
the layer has a sliding window). An fp8 cache's ``k_scale`` folds into the score
scale and ``v_scale`` into the output; gpt-oss's sinks join each row's softmax after the key
walk (``paged_attention_triton_common``).
"""

from __future__ import annotations

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
)


@triton.jit
def _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):  # type: ignore[no-untyped-def]
    """Largest ``s`` in ``[0, num_seqs)`` whose first query tile is ``<= tile``."""
    base = tl.load(qsl_ptr)
    lo = num_seqs * 0  # same (non-constexpr int32) type as hi: both are loop-carried
    hi = num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if (tl.load(qsl_ptr + mid) - base) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _locate_tile(qsl_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):  # type: ignore[no-untyped-def]
    """Grid tile -> ``(seq, q_start, q_len, q_tile)``: its sequence, the sequence's first row
    and query count, and the tile's index within the sequence (past its end: nothing to do)."""
    seq = _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_tile = tile - ((q_start - tl.load(qsl_ptr)) // BLOCK_Q + seq)
    return seq, q_start, q_len, q_tile


@triton.jit
def _load_q_tile(  # type: ignore[no-untyped-def]
    q_ptr,
    q_start,
    q_len,
    q_tile,
    kv_head,
    stride_qt,
    stride_qh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """The ``[BLOCK_M, BLOCK_D]`` query tile; per row ``m`` its query index within the
    sequence, query head, validity and absolute q/out row; the feature offsets and mask."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    tok = q_tile * BLOCK_Q + offs_m // GROUP  # query index within the sequence
    heads = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    rows = (q_start + tok).to(tl.int64)
    q_ptrs = q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    return q, tok, heads, row_mask, rows, offs_d, d_mask


@triton.jit
def _walk_keys(  # type: ignore[no-untyped-def]
    q,
    q_pos,  # [BLOCK_M] absolute position of each row's query
    q_tile,
    seq_len,
    context_len,
    window,
    chunk,
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
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    """The online softmax over the keys the tile's queries may see: ``(max, sum, acc)``."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)  # last query pos + 1
    # The tile's first query sees nothing before its window: start the key walk there.
    first_q = context_len + q_tile * BLOCK_Q
    kv_start = tl.maximum(tl.maximum(first_q - window + 1, 0), first_q // chunk * chunk)
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        pos_mask = pos < kv_end
        k, v = load_k_and_v(
            k_cache_ptr, v_cache_ptr, table_row, pos, pos_mask, kv_head, offs_d, d_mask,
            stride_cb, stride_cs, stride_ch, BLOCK_SIZE,
        )  # fmt: skip
        allowed = (pos[None, :] <= q_pos[:, None]) & pos_mask[None, :]
        allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        allowed = allowed & (pos[None, :] >= q_pos[:, None] // chunk * chunk)
        m_i, l_i, acc = online_softmax_step(
            q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_PRECISION, SOFT_CAP
        )
    return m_i, l_i, acc


@triton.jit
def _finish_rows(  # type: ignore[no-untyped-def]
    acc,
    m_i,
    l_i,
    out_ptr,
    rows,
    heads,
    row_mask,
    offs_d,
    d_mask,
    sinks_ptr,
    v_scale_ptr,
    stride_ot,
    stride_oh,
    FP8: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Fold the sinks in, normalize, apply the fp8 value scale and store the tile's rows."""
    if HAS_SINKS:  # one more softmax column per head, after every key
        sink = tl.load(sinks_ptr + heads).to(tl.float32) * LOG2_E_C
        l_i, alpha = fold_sink(m_i, l_i, sink)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if FP8:
        out = out * tl.load(v_scale_ptr)
    o_ptrs = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


# num_seqs is not specialized: Triton would turn a value of 1 into a constexpr, which cannot
# be a loop-carried variable in ``_find_seq``.
@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qsl_ptr,  # int32 [num_seqs + 1]; absolute row offsets into q/out
    num_seqs,
    k_scale_ptr,  # float32 [1]: fp8 cache scales, read only when FP8
    v_scale_ptr,
    sinks_ptr,  # [Hq] sink logits (gpt-oss), read only when HAS_SINKS
    qk_scale,
    window,  # query q sees keys q - window < k <= q (a huge value: no window)
    chunk,  # query q sees keys q // chunk * chunk <= k (Llama 4; a huge value: no chunks)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    seq, q_start, q_len, q_tile = _locate_tile(qsl_ptr, tile, num_seqs, BLOCK_Q)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    context_len = seq_len - q_len  # cached positions before this step's first query
    q, tok, heads, row_mask, rows, offs_d, d_mask = _load_q_tile(
        q_ptr, q_start, q_len, q_tile, kv_head, stride_qt, stride_qh,
        GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_Q,
    )  # fmt: skip
    m_i, l_i, acc = _walk_keys(
        q, context_len + tok, q_tile, seq_len, context_len, window, chunk, qk_scale,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head,
        offs_d, d_mask, stride_cb, stride_cs, stride_ch,
        BLOCK_M, BLOCK_D, BLOCK_Q, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, SOFT_CAP,
    )  # fmt: skip
    _finish_rows(
        acc, m_i, l_i, out_ptr, rows, heads, row_mask, offs_d, d_mask, sinks_ptr, v_scale_ptr,
        stride_ot, stride_oh, FP8, HAS_SINKS,
    )  # fmt: skip


def prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)``: common flash-attention tiles for Hopper, not yet
    tuned on a GPU. float32 (tests) keeps the smaller tile to bound registers."""
    if dtype != torch.float32 and head_dim > 64:
        return 128, 64, 8
    return 64, 64, 4


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_tokens: int,
    block_m: int | None = None,
    block_n: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    attention_chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Causal attention for the sequences of ``seq_lens`` (rows ``query_start_loc[i]:[i+1]``).

    ``num_tokens`` (host int) is the number of query rows these sequences own; it only sizes
    the grid. Results land in the same rows of ``out``. ``k_scale``/``v_scale``: an fp8
    cache's float32 [1] scales (``None`` = 1.0). ``logits_soft_cap``: Gemma 2's tanh cap
    (None: off); ``sliding_window``: query ``q`` sees keys ``q - window < k <= q``;
    ``attention_chunk`` (Llama 4): query ``q`` sees keys ``q // C * C <= k <= q``;
    ``sinks``: gpt-oss's per-query-head sink logits [Hq] (None: none).
    """
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // num_kv_heads
    default_m, default_n, warps = prefill_config(head_dim, query.dtype)
    # Every tile holds at least one token of all GROUP heads; tl.dot needs >= 16 rows.
    block_m = max(block_m or default_m, 16, next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    fp8 = is_fp8(k_cache)
    unit = unit_scale(query.device) if fp8 else seq_lens  # an unquantized cache reads neither
    _prefill_kernel[grid](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        num_seqs,
        unit if k_scale is None else k_scale, unit if v_scale is None else v_scale,
        seq_lens if sinks is None else sinks,  # no sinks: never read
        scale * LOG2_E,
        NO_WINDOW if sliding_window is None else sliding_window,
        NO_WINDOW if attention_chunk is None else attention_chunk,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n or default_n, BLOCK_SIZE=block_size,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        FP8=fp8,
        SOFT_CAP=logits_soft_cap or 0.0,
        HAS_SINKS=sinks is not None,
        num_warps=warps,
    )  # fmt: skip
