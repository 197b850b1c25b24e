"""FP8 KV cache: e4m3 storage with one float32 scale per layer for K and one for V.

A cache whose tensors are ``torch.float8_e4m3fn`` stores ``x / scale`` saturated to e4m3's
finite range (+-448) and rounded to nearest even; the kernels read ``stored * scale``. Any other
cache dtype stores K/V as they are and ignores the scales. A scale is a float32 tensor of one
element on the cache's device (not a Python float), so a checkpoint's or a calibrated scale can
be written into it in place after CUDA graphs were captured, and Triton reads it on device.

Why 1.0 when nothing gives a scale (vLLM's default too): e4m3 is a floating-point format, so its
relative rounding error (at most 2^-4) is the same at every magnitude of its normal range
[2^-6, 448]; a scale only slides that window. 1.0 leaves 448 as headroom for every future token,
while a scale fitted to one batch's largest value would saturate the first larger one; values
under 2^-6 lose relative precision (subnormals, absolute error <= 2^-10), which an attention
dot product over head_dim terms of order 0.1-10 does not feel.

``LayerKVCache`` is what the model's attention gets per layer: the two cache tensors and their
scales (``None`` for an unquantized cache).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


class LayerKVCache(NamedTuple):
    """One layer's paged cache, each tensor ``[num_blocks, block_size, Hkv, D]``."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None = None  # float32 [1]; read only when the cache is fp8
    v_scale: torch.Tensor | None = None


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds quantized (e4m3) K/V."""
    return cache.dtype == FP8_KV_DTYPE


@functools.cache
def unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 [1] scale of 1.0 on ``device``, for fp8 caches called without scales."""
    return torch.ones(1, dtype=torch.float32, device=device)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x / scale`` saturated to +-448 and rounded to nearest even, as e4m3 (float32 math)."""
    x = x.float()
    if scale is not None:
        x = x / scale
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` computed in float32 (e4m3 converts to it exactly), returned as ``dtype``."""
    out = x.to(torch.float32)
    if scale is not None:
        out.mul_(scale)
    return out.to(dtype)


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """What a store and a read of ``x`` through an fp8 cache give back, in ``x.dtype``."""
    return dequantize_fp8(quantize_fp8(x, scale), scale, x.dtype)
