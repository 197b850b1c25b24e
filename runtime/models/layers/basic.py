"""Plain (single-rank) parameter-holding layers for inference models: Linear, Embedding,
RMSNorm (and Gemma's variant, ``GemmaRMSNorm``).

Unlike ``torch.nn.Linear``/``nn.Embedding`` these never run a random initialiser: weights are
allocated uninitialised (``torch.empty``) because a loader always overwrites them. That makes
construction under ``torch.device(...)`` allocate straight on the target device at no compute
cost, and avoids meta-device init, whose ``normal_`` drags in ``torch._dynamo`` (~4 s import).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenwire.kernels.rmsnorm import fused_add_rms_norm, rms_norm


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)``; weight is ``[out_features, in_features]`` as in HF."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token id -> row of ``weight`` ``[vocab, hidden]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """Holds the norm weight (initialised to 1); the math lives in ``kernels.rmsnorm``."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = rms_norm(x, self.weight, self.eps)
        return out

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual)."""
        normed, summed = fused_add_rms_norm(x, residual, self.weight, self.eps)
        return normed, summed


class GemmaRMSNorm(RMSNorm):
    """Gemma 2/3 RMSNorm: the checkpoint stores ``w`` and the scale is ``1 + w``, applied in
    float32 before the cast back (HF ``Gemma2RMSNorm``: ``(x * (1 + w)).to(dtype)``, where
    Llama casts first). Op for op as HF, so float32 results are bit-identical. Weights start
    at 0 (scale 1). Plain torch ops on every device."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(size, eps, dtype)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return (hidden * (1.0 + self.weight.float())).type_as(x)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); the add in the input dtype, as HF."""
        summed = residual + x
        return self.forward(summed), summed


def make_rms_norm(size: int, eps: float, dtype: torch.dtype, unit_offset: bool) -> RMSNorm:
    """``GemmaRMSNorm`` when the checkpoint's norm weights are offsets from 1, else ``RMSNorm``."""
    return GemmaRMSNorm(size, eps, dtype) if unit_offset else RMSNorm(size, eps, dtype)
