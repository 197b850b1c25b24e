"""FP8 (e4m3) weight matmul: reference, one-time preparation, per-call dispatch.

Canonical layout: ``weight float8_e4m3fn [N, K]`` and ``scale float32 [N]`` (a per-tensor
scale is expanded to every row): ``W[n, k] = weight[n, k].float() * scale[n]``.

Backends (``choose_fp8_backend``):

- ``scaled_mm`` (CUDA, compute capability 8.9+, K and N multiples of 16): the activations are
  quantized to e4m3 per token (row scale ``amax / 448``, dynamic) and multiplied with
  ``torch._scaled_mm`` on the fp8 tensor cores: row-wise scales (``scale_a [M, 1]``,
  ``scale_b [1, N]``) on sm_90+ with a bfloat16 output; elsewhere (sm_89, or a float16 /
  float32 model) a float32 ``_scaled_mm`` with unit scales and the two scales applied after
  (vLLM's fallback). ``scaled_mm_emulated`` is the same arithmetic in torch (the tests' oracle).
- ``dequant``: ``F.linear`` on the de-quantized weight, per call (CUDA before sm_89).
- ``dense``: a de-quantized copy in the model dtype made once at prepare (CPU; see
  ``prepare_fp8``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
_MIN_SCALE = 1e-12  # an all-zero row keeps a tiny positive scale (codes 0)

Fp8Backend = Literal["scaled_mm", "dequant", "dense"]


@dataclass(frozen=True)
class Fp8Weights:
    """An fp8 linear's weights as its backend reads them (built by ``prepare_fp8``).

    ``weight``: float8 ``[N, K]`` (``scaled_mm``, ``dequant``) or the de-quantized ``[N, K]``
    in the model dtype (``dense``). ``scale``: float32 ``[N]``.
    """

    backend: Fp8Backend
    weight: torch.Tensor
    scale: torch.Tensor
    rowwise: bool = False  # scaled_mm: row-wise scales in one call (sm_90+, bfloat16)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The canonical fp8 weight as float32 ``[N, K]``: ``weight.float() * scale[:, None]``."""
    return weight.float() * scale.float().reshape(-1, 1)


def quantize_fp8_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[M, K]`` floating -> (e4m3 codes ``[M, K]``, float32 scales ``[M, 1]``), one scale
    per row: ``amax / 448`` (weights: per output channel; activations: per token). The
    codes are torch's round-to-nearest-even cast of ``x / scale``."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=_MIN_SCALE)
    codes = (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def fp8_matmul_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Weight-only: ``x @ dequantize(W).T + bias`` in ``x``'s dtype."""
    return F.linear(x, dequantize_fp8(weight, scale).to(x.dtype), bias)


def scaled_mm_emulated(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """What the ``scaled_mm`` backend computes, in float32 torch: per-token e4m3 activations
    times the e4m3 weight, accumulated in float32, scaled by both scales, plus bias."""
    shape = x.shape
    xq, x_scale = quantize_fp8_per_row(x.reshape(-1, shape[-1]))
    acc = xq.float() @ weight.float().t()
    out = acc * x_scale * scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*shape[:-1], -1)


def choose_fp8_backend(device: torch.device, in_features: int, out_features: int) -> Fp8Backend:
    """``scaled_mm`` on CUDA sm_89+ when K and N suit ``_scaled_mm`` (multiples of 16),
    ``dequant`` on other CUDA devices, ``dense`` on CPU."""
    if device.type != "cuda":
        return "dense"
    fits = in_features % 16 == 0 and out_features % 16 == 0
    if fits and torch.cuda.get_device_capability(device) >= (8, 9):
        return "scaled_mm"
    return "dequant"


def prepare_fp8(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    *,
    backend: Fp8Backend | None = None,
) -> Fp8Weights:
    """Prepare the canonical fp8 weight once. CPU (``dense``): torch has no fp8 CPU matmul,
    and de-quantizing per call costs more than the matmul itself at decode batch sizes (see
    the test module's timing note), so the de-quantized copy is kept (as the int8 ``dense``
    path does for float32). ``scaled_mm`` keeps the weight transposed to column-major, as
    ``_scaled_mm`` wants its second operand."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(f"fp8: weight must be float8_e4m3fn [N, K], got {weight.dtype}")
    n, k = weight.shape
    scale = scale.float().reshape(-1)
    if scale.numel() != n:
        raise ValueError(f"fp8: scale must have {n} elements (one per row), got {scale.numel()}")
    chosen = backend or choose_fp8_backend(weight.device, k, n)
    if chosen == "dense":
        return Fp8Weights("dense", dequantize_fp8(weight, scale).to(dtype), scale)
    if chosen == "scaled_mm":  # [N, K] row-major == [K, N] column-major: ``.t()`` is free
        sm90 = torch.cuda.get_device_capability(weight.device) >= (9, 0)
        rowwise = dtype == torch.bfloat16 and sm90
        return Fp8Weights("scaled_mm", weight.contiguous(), scale.contiguous(), rowwise)
    return Fp8Weights("dequant", weight.contiguous(), scale.contiguous())


def fp8_matmul(x: torch.Tensor, prepared: Fp8Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """``y = x @ W.T (+ bias)`` on the prepared fp8 weight, in ``x``'s dtype."""
    if prepared.backend == "dense":
        return F.linear(x, prepared.weight, bias)
    if prepared.backend == "dequant":
        return fp8_matmul_reference(x, prepared.weight, prepared.scale, bias)
    return _scaled_mm_cuda(x, prepared.weight, prepared.scale, bias, prepared.rowwise)


def _scaled_mm_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    rowwise: bool,
) -> torch.Tensor:
    """``torch._scaled_mm`` with per-token activation scales (CUDA, sm_89+)."""
    shape = x.shape
    xq, x_scale = quantize_fp8_per_row(x.reshape(-1, shape[-1]))
    w_t = weight.t()  # [K, N], column-major
    if rowwise and x.dtype == torch.bfloat16:
        out = torch._scaled_mm(
            xq,
            w_t,
            scale_a=x_scale,
            scale_b=scale.reshape(1, -1),
            bias=bias,
            out_dtype=torch.bfloat16,
        )
        return out.reshape(*shape[:-1], -1)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    acc = torch._scaled_mm(xq, w_t, scale_a=one, scale_b=one, out_dtype=torch.float32)
    out = acc * x_scale * scale.reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*shape[:-1], -1)
