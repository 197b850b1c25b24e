"""RMSNorm, plain and fused with the residual add.

Numerics follow HF ``LlamaRMSNorm`` op for op (variance and scaling in float32, cast back to
the input dtype, then multiply by the weight), so outputs are bit-identical to HF.
"""

from __future__ import annotations

import torch

from tokenwire.kernels.dispatch import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize over the last dimension of ``x``."""
    if use_triton(x):
        from tokenwire.kernels.rmsnorm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``: the next residual and its norm."""
    if use_triton(x):
        from tokenwire.kernels.rmsnorm_triton import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps)
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
