"""Absorbed-MLA attention over the paged latent cache: the Triton kernels or the torch path.

``mla_attention`` is what ``runtime.models.mla`` calls after storing the step's latents. For
CUDA tensors (or under ``TRITON_INTERPRET=1``) decode rows run the MLA decode kernel
(``mla_decode_triton``: one read of each latent tile per head group, values = the first
``kv_lora_rank`` key features) and prefill rows the generic Triton prefill kernel; elsewhere
the torch reference (``paged_attention_ref`` on the cache as one MQA head, values = keys).
``mla_attention_dense_ref`` is the tests' oracle: plain softmax attention per row over its
gathered latents.
"""

from __future__ import annotations

import torch

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.dispatch import use_triton
from tokenwire.kernels.kv_quant import dequantize_fp8, is_fp8
from tokenwire.kernels.paged_attention import paged_attention_ref


def mla_attention(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_lora_rank: int,
    cache_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``query`` [T, H, kv_lora_rank + rope] over ``latent_cache`` [blocks, block_size, 1,
    kv_lora_rank + rope] -> [T, H, kv_lora_rank] (the cache holds this step's latents).

    ``cache_scale``: an fp8 cache's float32 [1] scale (``None`` = 1.0).
    """
    if use_triton(query):
        from tokenwire.kernels.mla_decode_triton import mla_attention_triton

        return mla_attention_triton(query, latent_cache, meta, scale, kv_lora_rank, cache_scale)
    out = paged_attention_ref(
        query, query, query, latent_cache, latent_cache, meta, scale, cache_scale, cache_scale
    )
    return out[..., :kv_lora_rank]


def mla_attention_dense_ref(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_lora_rank: int,
    cache_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slow oracle in float64: each query row of each sequence attends, causally, the
    sequence's latents gathered position by position from its block table."""
    qsl, seq_lens = meta.query_start_loc_np, meta.seq_lens_np
    out = torch.zeros(*query.shape[:2], kv_lora_rank, dtype=query.dtype, device=query.device)
    cache = latent_cache
    if is_fp8(cache):
        cache = dequantize_fp8(cache, cache_scale, torch.float64)
    for seq in range(meta.num_seqs):
        first, last, seq_len = int(qsl[seq]), int(qsl[seq + 1]), int(seq_lens[seq])
        positions = torch.arange(seq_len, device=query.device)
        blocks = meta.block_tables[seq].long()[positions // meta.block_size]
        keys = cache[blocks, positions % meta.block_size, 0].double()  # [seq_len, D]
        for i, row in enumerate(range(first, last)):
            visible = keys[: seq_len - (last - first) + i + 1]
            scores = query[row].double() @ visible.T * scale  # [H, keys]
            probs = torch.softmax(scores, dim=-1)
            out[row] = (probs @ visible[:, :kv_lora_rank]).to(query.dtype)
    return out
