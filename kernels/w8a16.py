"""Int8 weight-only matmul ("w8a16"): reference, one-time preparation, per-call dispatch.

Canonical layout: ``qweight int8 [N, K]`` (signed codes), ``scales [N, G]`` with
``G = K // group_size`` (``G = 1``: per channel); ``W[n, k] = q[n, k] * scales[n, k // gs]``.

Backends (``w4a16.choose_backend``):

- ``triton``: ``quant_matmul_triton.w8a16_matmul_triton``.
- ``int8pack``: torch's CPU int8 kernel ``_weight_int8pack_mm`` (per-channel scales only),
  for bf16 matmuls.
- ``dequant``: dequantize per call (CUDA without triton).
- ``dense``: a dequantized copy made at prepare (CPU float32/fp16, or grouped scales).
- ``vnni``: ``kernels.vnni_matmul``'s int8 layout with float32 scales per 16 inputs
  (``pack_int8k_vnni``), for a GGUF kept quantized on CPU (``vnni=True``; Q8_0 / Q6_K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenwire.kernels.vnni_matmul import VnniWeights, pack_int8k_vnni, vnni_matmul, vnni_supported
from tokenwire.kernels.w4a16 import Backend, choose_backend


@dataclass(frozen=True)
class W8A16Weights:
    """An int8 linear's weights as its backend reads them (built by ``prepare_w8a16``).

    ``qweight``: int8 ``[N, K]``, or for ``dense`` the dequantized ``[N, K]`` in
    ``compute_dtype``. ``scales``: ``[N, G]``; int8pack: ``[N]`` in ``compute_dtype``.
    """

    backend: Backend
    out_features: int
    in_features: int
    group_size: int
    compute_dtype: torch.dtype
    qweight: torch.Tensor
    scales: torch.Tensor | None = None
    vnni: VnniWeights | None = None


def dequantize_w8a16(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """The canonical int8 weight as float32 ``[N, K]``: ``code * scale``."""
    n, k = qweight.shape
    grouped = qweight.float().view(n, k // group_size, group_size)
    return (grouped * scales.float()[:, :, None]).view(n, k)


def validate_w8a16(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[int, int]:
    """``(K, N)`` of a well-formed canonical int8 weight; ``ValueError`` otherwise."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"w8a16: qweight must be int8 [N, K], got {qweight.dtype}")
    n, k = qweight.shape
    if group_size <= 0 or k % group_size or scales.shape != (n, k // group_size):
        raise ValueError(
            f"w8a16: scales must be [{n}, K // group_size] with K={k}, group_size={group_size};"
            f" got {tuple(scales.shape)}"
        )
    return k, n


def prepare_w8a16(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    compute_dtype: torch.dtype | None = None,
    backend: Backend | None = None,
    vnni: bool = False,
) -> W8A16Weights:
    """Prepare the canonical int8 weights once (see ``w4a16.prepare_w4a16`` for the knobs;
    ``vnni``: on CPU with ``compute_dtype`` bfloat16, the VNNI kernel where this machine can)."""
    device = torch.device(device)
    k, n = validate_w8a16(qweight, scales, group_size)
    compute = compute_dtype or dtype
    per_channel = scales.shape[1] == 1
    chosen = backend or choose_backend(device, compute, cpu_packable=per_channel)
    fast = vnni and chosen in ("int4pack", "dense") and group_size in (16, 32)
    if backend == "vnni" or (fast and compute == torch.bfloat16 and vnni_supported(k, 32)):
        packed = pack_int8k_vnni(qweight, scales)
        return W8A16Weights(
            "vnni", n, k, group_size, compute, packed.weight, packed.scales, vnni=packed
        )
    if chosen == "int4pack":
        chosen = "int8pack"
    if chosen == "dense":
        weight = dequantize_w8a16(qweight, scales, group_size).to(device, compute)
        return W8A16Weights("dense", n, k, group_size, compute, weight)
    if chosen == "int8pack":
        if not per_channel:
            raise ValueError("int8pack: torch's CPU int8 kernel takes per-channel scales only")
        return W8A16Weights(
            "int8pack", n, k, group_size, compute, qweight.to(device).contiguous(),
            scales=scales[:, 0].to(device, compute).contiguous(),
        )  # fmt: skip
    return W8A16Weights(
        chosen, n, k, group_size, compute, qweight.to(device).contiguous(),
        scales=scales.to(device).contiguous(),
    )  # fmt: skip


def w8a16_matmul(
    x: torch.Tensor, w: W8A16Weights, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias) -> [..., N]`` in ``x.dtype``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    assert w.scales is not None or w.backend == "dense"
    if w.backend == "vnni":
        assert w.vnni is not None
        y = vnni_matmul(x2, w.vnni).to(x.dtype)
        y = y if bias is None else y + bias
    elif w.backend == "triton":
        from tokenwire.kernels.quant_matmul_triton import w8a16_matmul_triton

        assert w.scales is not None
        compute = None if w.compute_dtype == x.dtype else w.compute_dtype
        y = w8a16_matmul_triton(x2, w.qweight, w.scales, w.group_size, bias, compute_dtype=compute)
    elif w.backend == "int8pack":
        assert w.scales is not None
        xc = x2.to(w.compute_dtype).contiguous()
        y = torch._weight_int8pack_mm(xc, w.qweight, w.scales).to(x.dtype)
        y = y if bias is None else y + bias
    else:
        if w.backend == "dense":
            weight = w.qweight
        else:
            assert w.scales is not None
            weight = dequantize_w8a16(w.qweight, w.scales, w.group_size).to(w.compute_dtype)
        b = None if bias is None else bias.to(w.compute_dtype)
        y = F.linear(x2.to(w.compute_dtype), weight, b).to(x.dtype)
    return y.reshape(*lead, w.out_features)
