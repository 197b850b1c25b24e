"""The records a GGUF quantized tensor is read into: the canonical int4 and int8 layouts.

A linear weight in HF terms is W [N = out_features, K = in_features].

``GGUFInt4`` (GPTQ's layout, group ``g(k) = k // group_size``, no ``g_idx``):
``qweight`` int32 [K // 8, N], nibble j of ``qweight[r, n]`` is the code (0..15) of input row
``k = 8r + j``; ``scales`` and ``zeros`` [G, N]; ``W[n, k] = (code - zeros[g, n]) * scales[g, n]``.

``GGUFInt8``: ``qweight`` int8 [N, K], ``scales`` [N, G]; ``W[n, k] = qweight[n, k] *
scales[n, k // group_size]`` (``+ mins[n, k // 32]`` for Q5_K, whose codes are 0..31).

Scales and zeros are float32 here (GGUF's fp16 block scales convert exactly); the layer that
takes a record casts them to the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


def _check_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...], floating: bool) -> None:
    _check(tuple(t.shape) == shape, f"{name} shape {tuple(t.shape)} != {shape}")
    _check(t.is_floating_point() == floating, f"{name} has dtype {t.dtype}")


@dataclass(frozen=True, eq=False)
class GGUFInt4:
    """Int4 weight-only weight (from GGUF Q4_0 / Q4_1) in the canonical GPTQ layout."""

    qweight: torch.Tensor  # int32 [K // 8, N]
    scales: torch.Tensor  # float32 [G, N]
    zeros: torch.Tensor  # float32 [G, N], in code units
    group_size: int

    def __post_init__(self) -> None:
        _check(self.qweight.dim() == 2, f"qweight is {self.qweight.dim()}-D, not 2-D")
        _check(self.qweight.dtype == torch.int32, f"qweight has dtype {self.qweight.dtype}")
        k, n, group = self.in_features, self.out_features, self.group_size
        _check(group > 0 and k % group == 0, f"K={k} is not a multiple of group {group}")
        _check_tensor("scales", self.scales, (k // group, n), floating=True)
        _check_tensor("zeros", self.zeros, (k // group, n), floating=True)

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[0]) * 8

    def dequantize(self) -> torch.Tensor:
        """W [N, K] in the scales' dtype."""
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=self.qweight.device)
        codes = (self.qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF  # [K//8, 8, N]
        codes = codes.reshape(self.in_features, self.out_features).to(self.scales.dtype)
        scales = self.scales.repeat_interleave(self.group_size, dim=0)
        zeros = self.zeros.repeat_interleave(self.group_size, dim=0)
        return ((codes - zeros) * scales).t().contiguous()


@dataclass(frozen=True, eq=False)
class GGUFInt8:
    """Int8 weight-only weight (from GGUF Q8_0 / Q6_K / Q5_K) in the canonical layout."""

    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, G]
    group_size: int
    mins: torch.Tensor | None = None  # float32 [N, K // 32] (Q5_K), added to q * scale

    def __post_init__(self) -> None:
        _check(self.qweight.dim() == 2, f"qweight is {self.qweight.dim()}-D, not 2-D")
        _check(self.qweight.dtype == torch.int8, f"qweight has dtype {self.qweight.dtype}")
        k, n, group = self.in_features, self.out_features, self.group_size
        _check(group > 0 and k % group == 0, f"K={k} is not a multiple of group {group}")
        _check_tensor("scales", self.scales, (n, k // group), floating=True)
        if self.mins is not None:
            _check_tensor("mins", self.mins, (n, k // 32), floating=True)

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    def dequantize(self) -> torch.Tensor:
        """W [N, K] in the scales' dtype."""
        scales = self.scales.repeat_interleave(self.group_size, dim=1)
        w = self.qweight.to(self.scales.dtype) * scales
        return w if self.mins is None else w + self.mins.repeat_interleave(32, dim=1)
