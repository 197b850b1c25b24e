"""Triton paged attention entry point: decode rows through split-KV, the rest through prefill.

Rows ``[0, num_decodes)`` of the batch are one-token decodes (``AttentionMetadata``'s layout
invariant) and go to ``decode_attention``; the remaining sequences go to ``prefill_attention``
in one launch. Rows past the last sequence (padding) come back as zeros, as in the reference.
Only host integers already in the metadata size the grids, so nothing here syncs the device.
"""

from __future__ import annotations

import torch

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.paged_attention_triton_decode import decode_attention, default_num_splits
from tokenwire.kernels.paged_attention_triton_prefill import prefill_attention


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    attention_chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for every row of ``query`` [T, Hq, D] -> [T, Hq, D].

    ``k_scale``/``v_scale``: float32 [1] scales of an fp8 cache (``None`` = 1.0; ignored for
    other cache dtypes). ``num_splits`` overrides the decode split count;
    ``block_m``/``block_n`` override the tile sizes (tests use small tiles to cover tile
    boundaries on small shapes). ``logits_soft_cap``: Gemma 2's tanh cap (None: off);
    ``sliding_window``: query ``q`` sees keys ``q - window < k <= q`` (None: full causal).
    ``attention_chunk`` (Llama 4): query ``q`` sees keys ``q // C * C <= k <= q``.
    ``sinks`` (gpt-oss): a sink logit per query head [Hq], one more column of every row's
    softmax (None: none).
    """
    _check_layout(query, k_cache, v_cache)
    if sinks is not None and sinks.shape != (query.shape[1],):
        raise ValueError(f"paged attention: sinks must be [Hq], got {tuple(sinks.shape)}")
    sinks = None if sinks is None else sinks.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    nd, ns = meta.num_decodes, meta.num_seqs
    if nd > 0:
        splits = num_splits or default_num_splits(nd, k_cache.shape[2], query.device)
        decode_kwargs = {} if block_n is None else {"block_n": block_n}
        decode_attention(
            query, k_cache, v_cache, meta.seq_lens[:nd], meta.block_tables[:nd], out,
            scale, splits, k_scale=k_scale, v_scale=v_scale, logits_soft_cap=logits_soft_cap,
            sliding_window=sliding_window, attention_chunk=attention_chunk, sinks=sinks,
            **decode_kwargs,
        )  # fmt: skip
    if ns > nd:
        qsl = meta.query_start_loc_np
        prefill_attention(
            query, k_cache, v_cache, meta.query_start_loc[nd : ns + 1], meta.seq_lens[nd:ns],
            meta.block_tables[nd:ns], out, scale, int(qsl[ns] - qsl[nd]), block_m, block_n,
            k_scale, v_scale, logits_soft_cap, sliding_window, attention_chunk, sinks,
        )  # fmt: skip
    num_real = int(meta.query_start_loc_np[ns])
    if num_real < out.shape[0]:
        out[num_real:].zero_()
    return out


def _check_layout(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The kernels index with unit last strides and one set of cache strides for K and V."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged attention: k_cache and v_cache must be contiguous")
    if k_cache.shape != v_cache.shape:
        raise ValueError("paged attention: k_cache and v_cache shapes differ")
    if query.stride(2) != 1:
        raise ValueError("paged attention: query must have a unit last stride")
    if query.shape[1] % k_cache.shape[2] != 0:
        raise ValueError("paged attention: query heads must be a multiple of KV heads")
