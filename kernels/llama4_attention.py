"""Llama 4's per-head attention extras (torch; every device): the weightless q/k RMS norm of
its rope layers and the attention temperature of its NoPE layers, as HF's
``Llama4TextAttention`` computes them."""

from __future__ import annotations

import torch


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x ** 2) + eps)`` over the last dimension, in float32, back in
    ``x``'s dtype (HF's ``Llama4TextWeightlessRMSNorm``, its ``qk_norm``)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def attn_temperature_scales(
    positions: torch.Tensor, floor_scale: float, attn_scale: float
) -> torch.Tensor:
    """float32 [T]: ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` per position
    (HF's ``attn_temperature_tuning``; it multiplies the NoPE layers' queries)."""
    p = positions.float()
    return torch.log1p(torch.floor((p + 1.0) / floor_scale)) * attn_scale + 1.0
