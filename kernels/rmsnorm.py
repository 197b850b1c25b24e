"""RMSNorm, plain and fused with the residual add.

Numerics follow HF ``LlamaRMSNorm`` op for op (variance and scaling in float32, cast back to
the input dtype, then multiply by the weight), so outputs are bit-identical to HF.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize over the last dimension of ``x``."""
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``: the next residual and its norm."""
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    hidden = x.to(torch.float32)  # no copy when x is already float32
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # The add happens in the input dtype, as in HF's decoder layer (residual + hidden).
    new_residual = residual + x
    return rms_norm_ref(new_residual, weight, eps), new_residual
