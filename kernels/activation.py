"""Gated activations for fused MLP projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenwire.kernels.dispatch import use_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [..., 2 * I]`` laid out as gate then up -> [..., I]."""
    if use_triton(x):
        from tokenwire.kernels.activation_triton import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference; same ops as HF ``LlamaMLP`` (``act_fn(gate) * up``), so bit-identical."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
