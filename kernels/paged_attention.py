"""Paged attention over a flattened batch of decode and prefill rows.

The KV cache of one layer is ``k_cache``/``v_cache``, each ``[num_blocks, block_size,
num_kv_heads, head_dim]``; block 0 is the null block. ``paged_attention`` runs after
``store_kv`` has written this step's K/V, so every key a query may see is in the cache.

- ``build_cpu_plan`` (``attention_plan``): once per step, turns block tables into gather
  indices and masks, one set per sliding window of the model.
- ``paged_attention_ref``: the batched torch path (today's CPU hot path): each row a
  single-token query over a key range fixed by its own position, so a row's bits do not
  depend on the rest of the step (batch invariance, defects #20).
- ``paged_attention``: public entry point; dispatches to the Triton kernels
  (``paged_attention_triton``) for CUDA tensors or under ``TRITON_INTERPRET=1``, else to the
  reference.
- ``paged_attention_dense_ref``: slow, obviously-correct oracle for tests.

GQA convention (HF ``repeat_kv``): query head ``h`` reads KV head ``h // (Hq // Hkv)``.

An fp8 cache (``kv_quant``) is read as ``stored * k_scale`` / ``stored * v_scale``; the
reference de-quantizes what it gathers (every row reads the cache, so every path sees the same
keys and values as a later decode).

Attention sinks (gpt-oss, ``sinks``: float [Hq], a learned logit per query head added to the
softmax denominator) run in both.
Chunked local attention (Llama 4, ``attention_chunk``: the query at ``q`` sees keys
``q // C * C <= k <= q``) runs in both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenwire.kernels.attention_metadata import (
    AttentionMetadata,
    DecodeGroupPlan,
    PrefillSeqPlan,
)
from tokenwire.kernels.attention_plan import build_cpu_plan, plan_for_window
from tokenwire.kernels.dispatch import use_triton
from tokenwire.kernels.kv_quant import dequantize_fp8, is_fp8
from tokenwire.kernels.softcap_attention import AttentionFn, attention_fn

# (k_scale, v_scale) of an fp8 cache (a scale may be None: 1.0); None for any other cache.
_KVScales = tuple[torch.Tensor | None, torch.Tensor | None] | None


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Attention for every row of ``query`` [T, Hq, D] -> [T, Hq, D].

    ``k_scale``/``v_scale``: float32 [1] scales of an fp8 cache (``None`` = 1.0).
    ``logits_soft_cap``: Gemma 2's ``cap * tanh(scores / cap)`` on the scaled logits (None: off).
    ``sliding_window``: query ``q`` sees keys ``q - window < k <= q`` (None: full causal).
    ``sinks``: float [Hq] per-head sink logits (None: no sinks).
    ``attention_chunk``: query ``q`` sees keys ``q // C * C <= k <= q`` (Llama 4).
    """
    if use_triton(query):
        from tokenwire.kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(
            query, k_cache, v_cache, meta, scale, k_scale, v_scale,
            logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
            attention_chunk=attention_chunk, sinks=sinks,
        )  # fmt: skip
    return paged_attention_ref(
        query, key, value, k_cache, v_cache, meta, scale, k_scale, v_scale, logits_soft_cap,
        sliding_window, sinks, attention_chunk,
    )  # fmt: skip


def paged_attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Batched torch path: every row a single-token query over its canonical key range.

    One-token rows (decodes) are batched by padded length; longer rows (prefills, verify
    rows) by runs within their sequence, over one gather of its blocks. A row's result
    depends only on its query and its keys, not on the rest of the step (``attention_plan``).
    Every row reads its keys from the cache (this step's K/V are stored already), so
    ``key``/``value`` are not read here. Padding rows (past the last sequence) come back as
    zeros. The step's plan (``meta.cpu_plan``) is used when it was built for
    ``sliding_window`` / ``attention_chunk``; otherwise one is built here.
    """
    del key, value  # in the cache already (``store_kv`` ran first)
    span = (sliding_window, attention_chunk)
    plan = None if meta.cpu_plan is None else plan_for_window(meta.cpu_plan, *span)
    if plan is None:
        plan = build_cpu_plan(
            meta.query_start_loc_np,
            meta.seq_lens_np,
            meta.block_tables,
            meta.num_decodes,
            meta.block_size,
            () if sliding_window is None else (sliding_window,),
            () if attention_chunk is None else (attention_chunk,),
        )
        plan = plan_for_window(plan, *span)
        assert plan is not None
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    kv_scales = (k_scale, v_scale) if is_fp8(k_cache) else None
    num_kv_heads = k_cache.shape[2]
    # Sinks follow the folded GQA layout of ``_attend_rows``: [Hkv, Hq // Hkv, 1].
    folded = None if sinks is None else sinks.view(num_kv_heads, -1, 1)
    sdpa = attention_fn(logits_soft_cap, folded)
    for group in plan.decode_groups:
        _attend_decode_group(query, k_cache, v_cache, group, scale, kv_scales, out, sdpa)
    for prefill in plan.prefills:
        _attend_prefill(query, k_cache, v_cache, prefill, scale, kv_scales, out, sdpa)
    num_real = int(meta.query_start_loc_np[-1])
    if num_real < out.shape[0]:
        out[num_real:].zero_()
    return out


def _attend_rows(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sdpa: AttentionFn,
) -> torch.Tensor:
    """``query`` [n, Hq, D] rows, each one token over its keys ``k``/``v`` [n, kv_len, Hkv, D]
    (strided views) -> [n, Hq, D]. GQA by folding: the query heads sharing a KV head become
    that head's query rows, so sdpa runs plain multi-head attention on Hkv heads (a single
    token has no causal structure). Measured faster than enable_gqa=True and than
    repeat_interleave of K/V; sdpa reads strides (.contiguous() measured slower)."""
    n, num_heads, head_dim = query.shape
    num_kv_heads = k.shape[2]
    q = query.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = sdpa(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return o.reshape(n, num_heads, head_dim)


def _attend_decode_group(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroupPlan,
    scale: float,
    kv_scales: _KVScales,
    out: torch.Tensor,
    sdpa: AttentionFn = F.scaled_dot_product_attention,
) -> None:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    n = group.rows.shape[0]
    kv_len = group.max_blocks * block_size
    k = k_cache.index_select(0, group.block_ids).view(n, kv_len, num_kv_heads, head_dim)
    v = v_cache.index_select(0, group.block_ids).view(n, kv_len, num_kv_heads, head_dim)
    if kv_scales is not None:  # fp8: gathered at 1 byte per element, then de-quantized
        k = dequantize_fp8(k, kv_scales[0], query.dtype)
        v = dequantize_fp8(v, kv_scales[1], query.dtype)
    o = _attend_rows(query.index_select(0, group.rows), k, v, group.mask, scale, sdpa)
    out.index_copy_(0, group.rows, o)


def _attend_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefill: PrefillSeqPlan,
    scale: float,
    kv_scales: _KVScales,
    out: torch.Tensor,
    sdpa: AttentionFn = F.scaled_dot_product_attention,
) -> None:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    gathered = prefill.block_ids.shape[0] * block_size
    k = k_cache.index_select(0, prefill.block_ids).view(gathered, num_kv_heads, head_dim)
    v = v_cache.index_select(0, prefill.block_ids).view(gathered, num_kv_heads, head_dim)
    if kv_scales is not None:
        k = dequantize_fp8(k, kv_scales[0], query.dtype)
        v = dequantize_fp8(v, kv_scales[1], query.dtype)
    for g in prefill.groups:
        n = g.row_end - g.row_start
        keys = slice(g.key_offset, g.key_offset + g.kv_len)
        # The run's rows share one key range: a stride-0 batch view, no copy.
        kg = k[keys].unsqueeze(0).expand(n, -1, -1, -1)
        vg = v[keys].unsqueeze(0).expand(n, -1, -1, -1)
        out[g.row_start : g.row_end] = _attend_rows(
            query[g.row_start : g.row_end], kg, vg, g.mask, scale, sdpa
        )


def paged_attention_dense_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Oracle: per sequence, gather every context position from the cache one by one.

    Softmax in float32; causal by absolute position (within ``sliding_window`` when set); an
    fp8 cache is de-quantized in float32. Slow on purpose; tests only.
    """
    out = torch.zeros_like(query)
    block_size = k_cache.shape[1]
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    device = query.device  # any device: GPU tests use this oracle as the float32 reference
    kv_head = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)
    if not is_fp8(k_cache):
        k_scale = v_scale = None
    for i in range(len(meta.query_start_loc_np) - 1):
        start = int(meta.query_start_loc_np[i])
        end = int(meta.query_start_loc_np[i + 1])
        seq_len = int(meta.seq_lens_np[i])
        key_pos = torch.arange(seq_len, device=device)
        blocks = meta.block_tables[i].to(torch.int64)[key_pos // block_size]
        offsets = key_pos % block_size
        k = dequantize_fp8(k_cache[blocks, offsets], k_scale, torch.float32)[:, kv_head]
        v = dequantize_fp8(v_cache[blocks, offsets], v_scale, torch.float32)[:, kv_head]
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * scale
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=device)
        allowed = key_pos[None, :] <= query_pos[:, None]
        if sliding_window is not None:
            allowed &= key_pos[None, :] > query_pos[:, None] - sliding_window
        if attention_chunk is not None:
            allowed &= key_pos[None, :] // attention_chunk == query_pos[:, None] // attention_chunk
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # one more softmax column per head, dropped after
            sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
