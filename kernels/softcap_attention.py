"""Attention with tanh soft-capping of the logits (Gemma 2), for the torch reference path.

``softcap_sdpa`` has the calling convention of ``F.scaled_dot_product_attention`` as the paged
attention reference uses it (``[B, H, L, D]`` queries, ``[B, Hkv, S, D]`` keys and values, a
boolean ``attn_mask`` or top-left ``is_causal``, ``enable_gqa``), and computes what HF's
``eager_attention_forward`` does with ``softcap``: ``scores = q @ k.T * scale``, then
``softcap * tanh(scores / softcap)``, masked, softmax in float32, cast back, ``@ v``. sdpa
itself has no soft-cap, so this path materialises the scores.

Attention sinks (gpt-oss): a learned logit per query head joins each row's softmax as one more
column (HF's ``eager_attention_forward`` with ``sinks``: concatenated, the row max subtracted,
softmax, the sink column dropped), so a row's weights sum to less than 1. ``sinks`` is given
already shaped to broadcast against the scores ``[..., H, L, 1]``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

AttentionFn = Callable[..., torch.Tensor]


def softcap_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Soft-capped attention (``softcap`` None: no cap) with optional sinks; a ``True`` in
    ``attn_mask`` means "may attend"."""
    num_heads, num_kv_heads = query.shape[-3], key.shape[-3]
    if num_heads != num_kv_heads:
        if not enable_gqa:
            raise ValueError("query and key head counts differ; pass enable_gqa=True")
        key = key.repeat_interleave(num_heads // num_kv_heads, dim=-3)
        value = value.repeat_interleave(num_heads // num_kv_heads, dim=-3)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        q_len, k_len = scores.shape[-2], scores.shape[-1]
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1]
        return torch.matmul(probs.to(query.dtype), value)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)


def attention_fn(logits_soft_cap: float | None, sinks: torch.Tensor | None = None) -> AttentionFn:
    """``F.scaled_dot_product_attention``, or the eager equivalent when a soft-cap or sinks
    (shaped to broadcast against ``[..., H, L, 1]``) are set."""
    if logits_soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention
    return partial(softcap_sdpa, softcap=logits_soft_cap, sinks=sinks)
