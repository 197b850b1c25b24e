"""Rotary position embedding (HF's non-interleaved ``rotate_half`` convention).

Cache layout: ``cos_sin_cache`` is ``[max_position, head_dim]``; columns ``[:head_dim // 2]``
hold ``cos(pos * inv_freq)`` and ``[head_dim // 2:]`` hold ``sin(pos * inv_freq)`` (vLLM's
layout). Every value is computed with the same float32 ops, in the same order, as HF's
``LlamaRotaryEmbedding.forward`` + ``apply_rotary_pos_emb``, so results match HF bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from tokenwire.kernels.dispatch import use_triton

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def compute_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: Mapping[str, Any] | None
) -> torch.Tensor:
    """Float32 ``[head_dim // 2]`` inverse frequencies, as transformers' rope init computes.

    ``rope_scaling`` is a HF ``rope_parameters``/``rope_scaling`` dict (``rope_type`` or the
    legacy ``type`` key); None means plain rope.
    """
    params: Mapping[str, Any] = rope_scaling or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("unsupported rope parameter partial_rotary_factor != 1.0")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float)
    inv_freq = 1.0 / (rope_theta ** (exponents / head_dim))
    if rope_type == "linear":
        return inv_freq / _required(params, "factor")
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    return inv_freq


def _required(params: Mapping[str, Any], name: str) -> float:
    if name not in params:
        raise ValueError(f"rope_type {params.get('rope_type')!r} needs rope parameter {name!r}")
    return float(params[name])  # exact for the ints HF configs use (factor 8, context 8192)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency smoothing; same expressions as ``_compute_llama3_parameters``."""
    factor = _required(params, "factor")
    low_freq_factor = _required(params, "low_freq_factor")
    high_freq_factor = _required(params, "high_freq_factor")
    old_context_len = _required(params, "original_max_position_embeddings")

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


def build_cos_sin_cache(
    inv_freq: torch.Tensor, max_position: int, dtype: torch.dtype
) -> torch.Tensor:
    """``[max_position, head_dim]`` table: cos half then sin half, cast to ``dtype``.

    HF computes ``position.float() * inv_freq`` (an elementwise product, not a matmul) in
    float32 at every forward; the same product here gives the same bits, so precomputing
    loses nothing.
    """
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq.to(torch.float)[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` [T, H, D] and ``k`` [T, Hkv, D] at int64 ``positions`` [T]."""
    if use_triton(q):
        from tokenwire.kernels.rotary_triton import apply_rotary_triton

        return apply_rotary_triton(q, k, positions, cos_sin_cache)
    return apply_rotary_ref(q, k, positions, cos_sin_cache)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # each [T, 1, D/2], broadcast over heads
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), rotate_half(x) = cat(-x2, x1).
    # Per half that is x1*cos - x2*sin and x2*cos + x1*sin: the same products and sums
    # (negation is exact), kept as separate multiply and add ops so no FMA changes rounding.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
