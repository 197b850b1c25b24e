"""Bidirectional attention within an image's placeholder run (Gemma 3's prefill mask).

HF's Gemma 3 attends, during prefill, with OR(causal, same image) on full-attention layers
and AND(sliding window, OR(causal, same image)) on sliding layers (``token_type_ids``,
``create_masks_for_vision_model``). For a row at position ``p`` inside a run ``[start, end)``
both reduce to one key range: every key ``k < end`` (full) or ``p - window < k < end``
(sliding), since the keys past ``p`` it gains are exactly the run's. Rows outside any run
keep the causal result.

``image_run_attention`` recomputes those rows after ``paged_attention`` (any backend): the
step's K/V are in the cache already and the run lies whole inside the step (the scheduler
never splits it), so every key a row needs is stored. Each run's rows attend as one batch of
single-token queries over the sequence's first ``end`` keys gathered from the cache.
"""

from __future__ import annotations

import torch

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.kv_quant import dequantize_fp8, is_fp8
from tokenwire.kernels.softcap_attention import attention_fn


def image_run_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> None:
    """Overwrite ``out`` [T, Hq, D] on the rows inside ``meta.image_spans`` with their
    bidirectional-within-the-run attention (``query`` [T, Hq, D])."""
    sdpa = attention_fn(logits_soft_cap)
    for seq, start, end in meta.image_spans:
        rows, positions = _run_rows(meta, seq, start, end)
        if rows is None:
            continue
        k, v = _gather_keys(k_cache, v_cache, meta, seq, end, query.dtype, k_scale, v_scale)
        mask = None  # full layers: every key below ``end``
        if sliding_window is not None:
            keys = torch.arange(end, device=query.device)
            mask = (keys[None, :] > positions[:, None] - sliding_window)[:, None, None, :]
        n, num_heads, head_dim = query[rows].shape
        num_kv_heads = k.shape[1]
        q = query[rows].view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        kb = k.transpose(0, 1).unsqueeze(0).expand(n, -1, -1, -1)
        vb = v.transpose(0, 1).unsqueeze(0).expand(n, -1, -1, -1)
        o = sdpa(q, kb, vb, attn_mask=mask, scale=scale)
        out[rows] = o.reshape(n, num_heads, head_dim).to(out.dtype)


def _run_rows(
    meta: AttentionMetadata, seq: int, start: int, end: int
) -> tuple[slice | None, torch.Tensor]:
    """The step rows of sequence ``seq`` at positions in ``[start, end)`` and their positions."""
    lo, hi = int(meta.query_start_loc_np[seq]), int(meta.query_start_loc_np[seq + 1])
    first_position = int(meta.seq_lens_np[seq]) - (hi - lo)
    first, last = max(start, first_position), min(end, first_position + hi - lo)
    positions = torch.arange(first, max(first, last), device=meta.block_tables.device)
    if first >= last:
        return None, positions
    return slice(lo + first - first_position, lo + last - first_position), positions


def _gather_keys(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    seq: int,
    end: int,
    dtype: torch.dtype,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions ``[0, end)`` of sequence ``seq``: [end, Hkv, D] each."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_blocks = -(-end // block_size)
    blocks = meta.block_tables[seq, :num_blocks].to(torch.int64)
    k = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:end]
    v = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:end]
    if is_fp8(k_cache):
        k, v = dequantize_fp8(k, k_scale, dtype), dequantize_fp8(v, v_scale, dtype)
    return k, v
