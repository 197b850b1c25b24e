"""Gated activations for fused MLP projections: ``act(gate) * up`` for ``x = [..., 2 * I]``
laid out as gate then up.

- ``silu_and_mul``: SwiGLU (Llama, Mistral, Qwen, Phi-3).
- ``gelu_tanh_and_mul``: GeGLU with the tanh approximation of GELU (Gemma 2/3,
  ``hidden_activation="gelu_pytorch_tanh"``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenwire.kernels.dispatch import use_triton

# HF activation names (``hidden_act`` / ``hidden_activation``) -> gated activation.
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``x = [..., 2 * I]`` laid out as gate then up."""
    if use_triton(x):
        from tokenwire.kernels.activation_triton import gelu_tanh_and_mul_triton

        return gelu_tanh_and_mul_triton(x)
    return gelu_tanh_and_mul_ref(x)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference; same ops as HF ``Gemma2MLP`` with ``GELUTanh``, so bit-identical."""
    half = x.shape[-1] // 2
    return F.gelu(x[..., :half], approximate="tanh") * x[..., half:]


def gated_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``act_and_mul`` function for an HF activation name (see ``GATED_ACTIVATIONS``)."""
    if name == "silu":
        return silu_and_mul
    if name == "gelu_pytorch_tanh":
        return gelu_tanh_and_mul
    raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(GATED_ACTIVATIONS)}")
