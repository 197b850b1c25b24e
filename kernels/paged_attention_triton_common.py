"""Building blocks shared by the Triton decode and prefill attention kernels.

Both kernels walk a sequence's context in tiles of ``BLOCK_N`` key positions. A tile may span
several KV blocks, so each position looks up its own physical block in the block table
(``block_tables[seq, pos // BLOCK_SIZE]``); the positions of one block are contiguous in the
cache, so loads stay coalesced per ``head_dim`` row. Scores live in the log2 domain
(``qk_scale = scale * log2(e)``) so the softmax uses ``exp2``.

An fp8 cache's tiles are converted to the query dtype (exact: e4m3 fits float32, bfloat16 and
float16) and its scales are applied outside the dot products: ``k_scale`` multiplies
``qk_scale`` and ``v_scale`` the normalized output. That equals de-quantizing every element
first (``(q . k) * s == q . (k * s)``), without rounding ``k * s`` to a 16-bit query dtype and
with two scalar multiplies instead of one per cached element.

Gemma 2's logit soft-cap (``SOFT_CAP > 0``) is applied to the natural-log scores,
``cap * tanh(s / cap)``, before they return to the log2 domain; ``tanh`` is written with
``exp2`` so the interpreter and every backend share one formula. Sliding windows are masks
(and shorter key loops) in the kernels themselves.

Attention sinks (gpt-oss, ``HAS_SINKS``): a float per query head joins each row's softmax as
one more column with no value (``exp(sink - m)`` in the denominator, nothing in the
numerator), neither scaled nor soft-capped, as in the torch path. ``fold_sink`` adds it once,
after the key walk (prefill) or at the split combine (decode); a row that saw no key then
gets zeros, as the reference does.

``store_split_partial`` ends a split-KV decode program (this package's decode kernel and the
MLA decode kernel): each slice's normalized output and log2-sum-exp go to float32 scratch for
the reduce kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenwire.kernels.triton_compat import patch_interpreter_scalar_index

# Both attention kernels loop over runtime context lengths; see the shim's docstring.
patch_interpreter_scalar_index()

LOG2_E = 1.4426950408889634
# The same inside kernels: compiled Triton reads only constexpr globals (the interpreter
# reads any), so jitted code uses this one.
LOG2_E_C = tl.constexpr(LOG2_E)
# The window passed for full attention: larger than any context, and an int32 kernel argument.
NO_WINDOW = 1 << 30


@triton.jit
def load_kv_tile(  # type: ignore[no-untyped-def]
    cache_ptr,
    table_row_ptr,
    pos,
    pos_mask,
    kv_head,
    offs_d,
    d_mask,
    stride_block,
    stride_slot,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
):
    """``[BLOCK_N, D_PAD]`` cache rows of ``kv_head`` at absolute positions ``pos``.

    Masked positions read the null block's offset 0 address but load 0 instead.
    """
    block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    row = block * stride_block + (pos % BLOCK_SIZE) * stride_slot + kv_head * stride_head
    ptrs = cache_ptr + row[:, None] + offs_d[None, :]
    return tl.load(ptrs, mask=pos_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def load_k_and_v(  # type: ignore[no-untyped-def]
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    pos,
    pos_mask,
    kv_head,
    offs_d,
    d_mask,
    stride_block,
    stride_slot,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
):
    """``(k, v)``: ``load_kv_tile`` of the key cache, then of the value cache (same layout)."""
    k = load_kv_tile(
        k_cache_ptr, table_row_ptr, pos, pos_mask, kv_head, offs_d, d_mask,
        stride_block, stride_slot, stride_head, BLOCK_SIZE,
    )  # fmt: skip
    v = load_kv_tile(
        v_cache_ptr, table_row_ptr, pos, pos_mask, kv_head, offs_d, d_mask,
        stride_block, stride_slot, stride_head, BLOCK_SIZE,
    )  # fmt: skip
    return k, v


@triton.jit
def online_softmax_step(  # type: ignore[no-untyped-def]
    q,
    k,
    v,
    allowed,
    m_i,
    l_i,
    acc,
    qk_scale,
    DOT_PRECISION: tl.constexpr,
    SOFT_CAP: tl.constexpr = 0.0,
):
    """Fold one key tile into the running ``(max, sum, acc)`` of each query row.

    ``q`` [M, D], ``k``/``v`` [N, D] in the query dtype or fp8 (converted here, unscaled),
    ``allowed`` [M, N] (False = masked). ``m_i`` is the
    running max in log2 units, ``-inf`` while a row has seen no allowed key; such rows keep
    ``l_i == 0`` and ``acc == 0`` (the ``m_safe`` shift avoids ``inf - inf``).
    """
    k = k.to(q.dtype)  # no-op unless the cache is fp8
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFT_CAP > 0.0:
        s = soft_cap_log2(s, SOFT_CAP)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def soft_cap_log2(s, SOFT_CAP: tl.constexpr):  # type: ignore[no-untyped-def]
    """``cap * tanh(x / cap)`` of scores ``s = x * log2(e)`` held in log2 units.

    ``tanh(y) = 1 - 2 / (exp(2y) + 1)``; ``exp(2y)`` overflows to ``inf`` for large ``y``,
    which gives exactly 1, and underflows to 0 for very negative ``y``, which gives -1.
    """
    y = s / (LOG2_E_C * SOFT_CAP)  # x / cap
    tanh = 1.0 - 2.0 / (tl.exp2(2.0 * LOG2_E_C * y) + 1.0)
    return tanh * (SOFT_CAP * LOG2_E_C)


@triton.jit
def fold_sink(m_i, l_i, sink):  # type: ignore[no-untyped-def]
    """Fold one sink column ``sink`` [M] (log2 units) into running ``(max, sum)`` [M].

    Returns ``(l, alpha)``: the new sum and the factor the accumulator (or each partial
    output's weight) must be multiplied by. ``m_i == -inf`` (no key) gives ``alpha == 0``.
    """
    m_new = tl.maximum(m_i, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a -inf sink and no key: no inf - inf
    alpha = tl.exp2(m_i - m_safe)
    return l_i * alpha + tl.exp2(sink - m_safe), alpha


@triton.jit
def store_split_partial(  # type: ignore[no-untyped-def]
    acc,
    m_i,
    l_i,
    mid_o_ptr,
    mid_lse_ptr,
    v_scale_ptr,
    seq,
    heads,
    h_mask,
    split,
    num_splits,
    offs_d,
    d_mask,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
):
    """Split-KV decode: store one slice's normalized output and log2-sum-exp (``-inf`` when
    it saw no key) to the float32 scratch ``mid_o [.., NUM_HEADS, num_splits, HEAD_DIM]``,
    ``mid_lse [.., NUM_HEADS, num_splits]``; an fp8 cache's ``v_scale`` multiplies the output."""
    has_keys = l_i > 0.0
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if FP8:
        out = out * tl.load(v_scale_ptr)
    row = (seq * NUM_HEADS + heads) * num_splits + split  # [BLOCK_H] rows of mid_o/mid_lse
    tl.store(mid_lse_ptr + row, lse, mask=h_mask)
    o_ptrs = mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, out, mask=h_mask[:, None] & d_mask[None, :])
