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

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def compute_inv_freq(
    head_dim: int,
    rope_theta: float,
    rope_scaling: Mapping[str, Any] | None,
    max_position: int | None = None,
) -> torch.Tensor:
    """Float32 ``[head_dim // 2]`` inverse frequencies, as transformers' rope init computes.

    ``rope_scaling`` is a HF ``rope_parameters``/``rope_scaling`` dict (``rope_type`` or the
    legacy ``type`` key); None means plain rope. ``max_position`` (the served context length)
    only matters for ``longrope``: see ``_longrope_inv_freq``.
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
    if rope_type == "longrope":
        return _longrope_inv_freq(head_dim, rope_theta, params, max_position)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope_theta, params)
    return inv_freq


def rope_attention_scaling(rope_scaling: Mapping[str, Any] | None) -> float:
    """The factor HF multiplies cos and sin by (``attention_scaling``); 1.0 unless longrope
    or YaRN (``_yarn_attention_factor``).

    LongRoPE (Phi-3): ``attention_factor`` when given, else ``sqrt(1 + ln(factor) /
    ln(original_max_position_embeddings))`` for ``factor > 1`` (``_compute_longrope_parameters``).
    """
    params: Mapping[str, Any] = rope_scaling or {}
    if params.get("rope_type", params.get("type")) == "yarn":
        return _yarn_attention_factor(params)
    if params.get("rope_type", params.get("type")) != "longrope":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _required(params, "factor")
    if factor <= 1.0:
        return 1.0
    original = _required(params, "original_max_position_embeddings")
    return math.sqrt(1 + math.log(factor) / math.log(original))


def _longrope_inv_freq(
    head_dim: int, rope_theta: float, params: Mapping[str, Any], max_position: int | None
) -> torch.Tensor:
    """LongRoPE: per-frequency divisors, ``long_factor`` beyond the pretraining length.

    HF picks the factor set per forward from the current sequence length (long once it exceeds
    ``original_max_position_embeddings``). A paged cache keeps keys rotated at earlier steps,
    so the choice here is static per served context: the long factors when ``max_position``
    (``max_model_len``) exceeds ``original_max_position_embeddings``, else the short ones.
    That equals HF for every sequence when ``max_model_len`` is within the original length,
    and for sequences already longer than it from their first forward otherwise.
    """
    original = _required(params, "original_max_position_embeddings")
    use_long = max_position is not None and max_position > original
    key = "long_factor" if use_long else "short_factor"
    if key not in params:
        raise ValueError(f"rope_type 'longrope' needs rope parameter {key!r}")
    ext_factors = torch.tensor(list(params[key]), dtype=torch.float32)
    if ext_factors.shape != (head_dim // 2,):
        raise ValueError(
            f"rope parameter {key!r} has {ext_factors.numel()} entries, expected {head_dim // 2}"
        )
    inv_freq_shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext_factors * rope_theta**inv_freq_shape)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(params: Mapping[str, Any]) -> float:
    """YaRN's cos/sin factor: ``attention_factor`` when given, else HF's mscale rule."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _required(params, "factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_inv_freq(head_dim: int, base: float, params: Mapping[str, Any]) -> torch.Tensor:
    """YaRN (gpt-oss): same expressions as HF's ``_compute_yarn_parameters``: interpolated
    and extrapolated frequencies blended by a linear ramp over the correction range."""
    factor = _required(params, "factor")
    original = _required(params, "original_max_position_embeddings")
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a singular ramp
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)
    extrapolation_factor = 1 - torch.clamp(ramp, 0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    return (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )


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
    inv_freq: torch.Tensor, max_position: int, dtype: torch.dtype, scaling: float = 1.0
) -> torch.Tensor:
    """``[max_position, head_dim]`` table: cos half then sin half, cast to ``dtype``.

    HF computes ``position.float() * inv_freq`` (an elementwise product, not a matmul) in
    float32 at every forward; the same product here gives the same bits, so precomputing
    loses nothing. ``scaling`` (``rope_attention_scaling``) multiplies cos and sin in float32
    before the cast, as HF does (a multiplication by 1.0 is exact).
    """
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq.to(torch.float)[None, :]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1).to(dtype)


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
