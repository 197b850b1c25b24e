"""A linear kept quantized as VNNI weights side by side along its output: a GGUF fused layer
whose parts differ in type (Q4_K_M's Q4_K q/k beside a Q6_K v) or a Q5_K layer.

Why parts, not one layout: widening Q4_K's int4 q/k to int8 beside the v would be exact but
would double their bytes (the decode step streams every weight once), and de-quantizing them
(as before) quadruples them; each part in its own kind keeps every byte as the file has it
and costs one more operator call (``fused_layers`` runs the parts in one linear, with the
activations quantized once).

Canonical layout (the loader's, ``runtime.models.layers.quant.gguf_kquant``): ``codes`` int8
``[N, K]``, float32 ``scales`` per 16 inputs ``[N, K / 16]`` and ``mins`` per 32 ``[N, K /
32]``: ``W = code * scale + min``. ``parts``: ``(rows, kind)`` along N, ``int4`` (codes 0..15;
``kernels.vnni_matmul.pack_int4_vnni``, fp16 scales and minimums as every kept Q4 layer) or
``int8`` (``pack_int8k_vnni``, float32: exact). On CUDA (or the Triton interpreter) the
canonical layout itself is kept and ``kernels.quant_matmul_triton``'s int8 kernel de-quantizes
``code * scale + min`` per tile in float32 (exact before the dot): 8 bits a weight plus its
scales and minimums (11 bits), against 16 for a bf16 copy; the int4 parts' codes take a byte
each there (packing them is left for later). Otherwise the layer keeps a de-quantized float
copy (``dense``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from tokenwire.kernels.vnni_matmul import (
    VnniWeights,
    pack_int4_vnni,
    pack_int8k_vnni,
    vnni_matmul,
)

PartKind = Literal["int4", "int8"]


@dataclass(frozen=True)
class VnniParts:
    """A linear's prepared weights: its VNNI parts in output order, or a dense copy."""

    out_features: int
    in_features: int
    parts: tuple[VnniWeights, ...]
    dense: torch.Tensor | None = None  # [N, K] in the model dtype, when not VNNI
    # The canonical (codes, scales, mins) for the Triton kernel (CUDA, or the interpreter).
    canonical: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def dequantize_kquant(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """The canonical weight as float32 ``[N, K]``: ``code * scale + min``."""
    n, k = codes.shape
    w = codes.float().view(n, k // 16, 16) * scales.float()[..., None]
    return (w.view(n, k // 32, 32) + mins.float()[..., None]).view(n, k)


def _merged(parts: tuple[tuple[int, PartKind], ...]) -> list[tuple[int, int, PartKind]]:
    """Consecutive parts of one kind as one ``(start, stop, kind)`` row range."""
    ranges: list[tuple[int, int, PartKind]] = []
    start = 0
    for rows, kind in parts:
        if ranges and ranges[-1][2] == kind:
            ranges[-1] = (ranges[-1][0], start + rows, kind)
        else:
            ranges.append((start, start + rows, kind))
        start += rows
    return ranges


def prepare_vnni_parts(
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    parts: tuple[tuple[int, PartKind], ...],
    *,
    vnni: bool,
    dtype: torch.dtype,
    triton: bool = False,
) -> VnniParts:
    """Pack the canonical weight once: per part range when ``vnni``, kept as it is for the
    Triton kernel when ``triton``, else a dense copy."""
    n, k = codes.shape
    if sum(rows for rows, _ in parts) != n:
        raise ValueError(f"qweight: parts of {[r for r, _ in parts]} rows do not make {n}")
    if triton:
        kept = (codes.contiguous(), scales.float().contiguous(), mins.float().contiguous())
        return VnniParts(n, k, (), canonical=kept)
    if not vnni:
        return VnniParts(n, k, (), dequantize_kquant(codes, scales, mins).to(dtype))
    packed: list[VnniWeights] = []
    ranges = _merged(parts)
    for i, (start, stop, kind) in enumerate(ranges):
        if i < len(ranges) - 1 and (stop - start) % 16:
            raise ValueError(f"qweight: a part of {stop - start} rows is not whole tiles of 16")
        c, s, m = codes[start:stop], scales[start:stop], mins[start:stop]
        if kind == "int4":
            packed.append(pack_int4_vnni(c.to(torch.uint8), s[:, ::2], m))
        else:
            packed.append(pack_int8k_vnni(c, s, m if bool(m.any()) else None))
    return VnniParts(n, k, tuple(packed))


def vnni_parts_matmul(
    x: torch.Tensor, w: VnniParts, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias) -> [..., N]`` in ``x.dtype``."""
    if w.canonical is not None:
        from tokenwire.kernels.quant_matmul_triton import w8a16_matmul_triton

        codes, scales, mins = w.canonical
        x2 = x.reshape(-1, w.in_features)
        y = w8a16_matmul_triton(x2, codes, scales, 16, bias, mins=mins, min_group=32)
        return y.reshape(*x.shape[:-1], w.out_features)
    if w.dense is not None:
        y = F.linear(x.to(w.dense.dtype), w.dense).to(x.dtype)
    else:
        y = torch.cat([vnni_matmul(x, p) for p in w.parts], dim=-1).to(x.dtype)
    return y if bias is None else y + bias
