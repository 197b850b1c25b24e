"""Int4 weight-only matmul ("w4a16"): reference, one-time repacking, per-call dispatch.

Canonical layout (the loaders' contract): ``qweight int32 [K // 8, N]`` (nibble j of row r =
code of input row ``8r + j``), ``scales``/``zeros`` ``[G, N]``, optional act-order
``g_idx int32 [K]``; ``W[n, k] = (code(k, n) - zeros[g(k), n]) * scales[g(k), n]``.

Act-order: when every group has exactly ``group_size`` rows (what GPTQ writes), ``prepare``
sorts K by group once and each call gathers ``x``'s columns with that permutation, so every
backend sees contiguous groups. Any other ``g_idx`` is kept: the Triton kernel gathers scales
per row and the torch paths dequantize with it.

Backends (``choose_backend`` says which runs where, and why; ``w8a16`` shares it):

- ``triton``: ``quant_matmul_triton`` on the canonical (K-sorted) layout.
- ``vnni``: ``kernels.vnni_matmul`` (int8 activations per 32-block against the int4 codes in
  integer dot products, AVX-512 VNNI): 1.05x ``int4pack``'s speed at 1 row, 1.6x at 16,
  1.9x at 128 (SmolLM2-135M's linears, 1 thread), and ~60x more precise (a residual int8
  part keeps ~15 bits of each activation). Batch invariant; not exact. Runs where
  ``int4pack`` would when the caller asks (``vnni=True``: a GGUF kept quantized with
  ``--cpu-quant-kernel`` auto / vnni) and the CPU and a C++ compiler allow it.
- ``int4pack``: torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``), which computes
  ``(q - 8) * scale + zero``; so its zero is ``(8 - zeros) * scales``. Needs N % 16 == 0
  (rows are padded) and a group size of 32/64/128/256 (larger groups repeat their scales).
  It runs every call, whatever its number of rows: the kernel computes each output row with
  the same chain of float32 FMAs over K (blocks of 1-4 rows share only the de-quantized
  weights), so a row's bits do not depend on what else is batched with it (defects #20). A
  bf16 de-quantized copy for calls of more than 4 rows (AMX, 5-30x faster there) gave a row
  other bits than the int4 kernel, so greedy output depended on the batch.
- ``dequant``: dequantize to float32 per call, then one matmul (exact; slow on CPU).
- ``dense``: a dequantized copy made at prepare (exact, fast; 8x the int4 bytes in float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from tokenwire.kernels.dispatch import use_triton
from tokenwire.kernels.vnni_matmul import VnniWeights, pack_int4_vnni, vnni_matmul, vnni_supported

Backend = Literal["triton", "vnni", "int4pack", "int8pack", "dequant", "dense"]
_INT4PACK_GROUP_SIZES = (256, 128, 64, 32)


def choose_backend(
    device: torch.device, compute_dtype: torch.dtype, *, cpu_packable: bool
) -> Backend:
    """Which path runs a quantized matmul; measured by ``scripts/quant_matmul_cost.py``
    (SmolLM2-135M shapes, weights streamed from memory as in a real decode, 1 thread).

    - CUDA (or the CPU interpreter, as ``dispatch.use_triton``): the Triton kernel; a CUDA box
      without triton dequantizes per call (keeps the weights quantized in GPU memory).
    - CPU, bf16 matmuls, a layout torch's packed kernels take (``cpu_packable``): ``int4pack``
      / ``int8pack``. A decode step costs 0.25x (int4) / 0.6x (int8) of float32 ``F.linear``;
      at M = 64 they are compute-poor (about 1.5x float32 ``F.linear``, 5x bf16 ``F.linear``),
      still ahead of dequantizing per call.
    - CPU, anything else (float32, fp16, other group layouts): ``dense``, a dequantized copy
      in the compute dtype (exact; memory of an unquantized model). The exact alternatives
      keep the weights quantized but cost more than one ``F.linear``: the packed kernels take
      float32 (6-8x at M = 1, ~100x at M = 64) and fp16 (~40x) activations on slow reference
      loops, and dequantizing per call costs 7-13x at M = 1. A float32 model can opt into
      ``compute_dtype=torch.bfloat16`` instead (packed kernel, activations cast: not exact).
    """
    if use_triton(torch.empty(0, device=device)):
        return "triton"
    if device.type == "cuda":
        return "dequant"
    if compute_dtype == torch.bfloat16 and cpu_packable:
        return "int4pack"
    return "dense"


def _choose(
    device: torch.device,
    compute: torch.dtype,
    cpu_packable: bool,
    vnni: bool,
    shape: tuple[int, int],
) -> Backend:
    """``choose_backend``, with ``vnni`` in place of ``int4pack`` where asked and possible."""
    chosen = choose_backend(device, compute, cpu_packable=cpu_packable)
    if chosen == "int4pack" and vnni and vnni_supported(*shape):
        return "vnni"
    return chosen


@dataclass(frozen=True)
class W4A16Weights:
    """An int4 linear's weights as its backend reads them (built by ``prepare_w4a16``).

    ``qweight``: triton/dequant: canonical ``int32 [K // 8, N]`` (K sorted by group when
    ``perm`` is set); int4pack: torch's CPU packing ``uint8 [N_pad, K // 2]``; dense: the
    dequantized ``[N, K]`` in ``compute_dtype``. ``scales``/``zeros``: ``[G, N]``, except
    int4pack (``scales`` = torch's ``scales_and_zeros [G, N_pad, 2]``, ``zeros`` None).
    ``perm``: int64 ``[K]``, gathered from ``x``'s columns per call (act-order).
    """

    backend: Backend
    out_features: int
    in_features: int
    group_size: int
    compute_dtype: torch.dtype
    qweight: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    vnni: VnniWeights | None = None


# --- layout helpers ------------------------------------------------------------------------


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Canonical ``int32 [K // 8, N]`` -> codes ``int32 [K, N]`` in ``[0, 16)``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    codes = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF
    return codes.reshape(-1, qweight.shape[1])


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[K, N]`` in ``[0, 16)`` -> canonical ``int32 [K // 8, N]``."""
    k, n = codes.shape
    rows = codes.to(torch.int32).reshape(k // 8, 8, n)
    packed = torch.zeros(k // 8, n, dtype=torch.int32, device=codes.device)
    for j in range(8):
        packed |= rows[:, j] << (4 * j)  # j = 7 wraps into the sign bit, as GPTQ stores it
    return packed


def act_order(
    g_idx: torch.Tensor | None, group_size: int, k: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(perm, g_idx)`` still needed: ``perm`` sorts K into contiguous groups of
    ``group_size`` rows; ``g_idx`` survives only when no such sort exists."""
    if g_idx is None:
        return None, None
    groups = g_idx.long()
    natural = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(groups, natural):
        return None, None
    perm = torch.argsort(groups, stable=True)
    if torch.equal(groups[perm], natural):
        return perm, None
    return None, g_idx


def int4pack_group_size(group_size: int, k: int) -> int | None:
    """The group size torch's CPU int4 kernel runs for ``group_size`` (scales repeated)."""
    for size in _INT4PACK_GROUP_SIZES:
        if group_size % size == 0 and k % size == 0:
            return size
    return None


def _pack_for_cpu(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    packed_gs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(uint8 [N_pad, K // 2], float32 scales_and_zeros [G', N_pad, 2])`` for int4pack."""
    codes = unpack_int4(qweight).t()  # [N, K]
    n = codes.shape[0]
    pad = -n % 16
    codes = F.pad(codes, (0, 0, 0, pad), value=8).contiguous()  # padded rows: code 8 ...
    scale = scales.float().repeat_interleave(group_size // packed_gs, 0)
    zero = (8.0 - zeros.float().repeat_interleave(group_size // packed_gs, 0)) * scale
    scales_zeros = F.pad(torch.stack([scale, zero], -1), (0, 0, 0, pad))  # ... scale 0, zero 0
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.cpu(), 2)
    return packed, scales_zeros[: codes.shape[1] // packed_gs].contiguous()


def _pack_vnni(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> VnniWeights:
    """Canonical int4 -> ``kernels.vnni_matmul``'s layout: ``W = scale * code + min`` per
    32-block, ``min = -zero * scale`` (scales repeated over a larger group)."""
    repeat = group_size // 32
    scale = scales.float().repeat_interleave(repeat, 0)
    mins = -zeros.float().repeat_interleave(repeat, 0) * scale
    return pack_int4_vnni(unpack_int4(qweight).t(), scale.t(), mins.t())


def validate_w4a16(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
) -> tuple[int, int]:
    """``(K, N)`` of a well-formed canonical int4 weight; ``ValueError`` otherwise."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"w4a16: qweight must be int32 [K // 8, N], got {qweight.dtype}")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if scales.dim() != 2 or scales.shape[1] != n or zeros.shape != scales.shape:
        raise ValueError(f"w4a16: scales/zeros must be [G, {n}], got {scales.shape}/{zeros.shape}")
    if g_idx is None and (group_size <= 0 or k % group_size or scales.shape[0] != k // group_size):
        raise ValueError(f"w4a16: K={k} with group_size={group_size} and G={scales.shape[0]}")
    if g_idx is not None and (g_idx.shape != (k,) or int(g_idx.max()) >= scales.shape[0]):
        raise ValueError(f"w4a16: g_idx must be [{k}] with values < {scales.shape[0]}")
    return k, n


# --- reference -----------------------------------------------------------------------------


def dequantize_w4a16(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """The canonical int4 weight as float32 ``[N, K]``: ``(code - zero) * scale``."""
    return _dequantize_kn(qweight, scales, zeros, g_idx, group_size).t().contiguous()


def _dequantize_kn(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """float32 ``W.T [K, N]``; contiguous groups broadcast instead of gathering."""
    codes = unpack_int4(qweight).float()
    k, n = codes.shape
    if g_idx is None:
        grouped = codes.view(k // group_size, group_size, n)
        return ((grouped - zeros.float()[:, None]) * scales.float()[:, None]).view(k, n)
    groups = g_idx.long()
    return (codes - zeros.float()[groups]) * scales.float()[groups]


# --- prepare and matmul --------------------------------------------------------------------


def prepare_w4a16(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    compute_dtype: torch.dtype | None = None,
    backend: Backend | None = None,
    vnni: bool = False,
) -> W4A16Weights:
    """Repack the canonical int4 weights once, for the backend that will run them.

    ``dtype``: the activations' dtype. ``compute_dtype``: the matmul's (default ``dtype``);
    ``torch.bfloat16`` with float32 activations opts a float32 model into bf16 matmuls
    (activations cast per call; not exact). ``backend``: force one (tests, measurements).
    ``vnni``: where ``int4pack`` would run, run ``vnni`` if this machine can
    (``--cpu-quant-kernel``).
    """
    device = torch.device(device)
    k, n = validate_w4a16(qweight, scales, zeros, g_idx, group_size)
    compute = compute_dtype or dtype
    perm, g_idx_left = act_order(g_idx, group_size, k)
    packed_gs = int4pack_group_size(group_size, k)
    cpu_packable = packed_gs is not None and g_idx_left is None
    chosen = backend or _choose(device, compute, cpu_packable, vnni, (k, group_size))
    if chosen == "dense":  # the dequantized copy needs no permutation
        weight = dequantize_w4a16(qweight, scales, zeros, g_idx, group_size).to(device, compute)
        return W4A16Weights("dense", n, k, group_size, compute, weight)
    if perm is not None:
        qweight = pack_int4(unpack_int4(qweight).index_select(0, perm))
        perm = perm.to(device)
    if chosen == "vnni":
        if g_idx_left is not None or not vnni_supported(k, group_size):
            raise ValueError(f"vnni: unsupported group_size {group_size}, g_idx or machine")
        packed4 = _pack_vnni(qweight, scales, zeros, group_size)
        return W4A16Weights(
            "vnni", n, k, group_size, compute, packed4.weight, perm=perm, vnni=packed4
        )
    if chosen == "int4pack":
        if packed_gs is None or g_idx_left is not None:
            raise ValueError(f"int4pack: unsupported group_size {group_size} or g_idx")
        packed, scales_zeros = _pack_for_cpu(qweight, scales, zeros, group_size, packed_gs)
        return W4A16Weights(
            "int4pack", n, k, packed_gs, compute, packed.to(device),
            scales=scales_zeros.to(device, compute), perm=perm,
        )  # fmt: skip
    return W4A16Weights(
        chosen, n, k, group_size, compute, qweight.to(device).contiguous(),
        scales=scales.to(device).contiguous(), zeros=zeros.to(device).contiguous(),
        g_idx=None if g_idx_left is None else g_idx_left.to(device, torch.int32), perm=perm,
    )  # fmt: skip


def w4a16_matmul(
    x: torch.Tensor, w: W4A16Weights, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias) -> [..., N]`` in ``x.dtype``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    if w.backend == "triton":
        from tokenwire.kernels.quant_matmul_triton import w4a16_matmul_triton

        assert w.scales is not None and w.zeros is not None
        compute = None if w.compute_dtype == x.dtype else w.compute_dtype
        y = w4a16_matmul_triton(
            x2, w.qweight, w.scales, w.zeros, w.g_idx, w.group_size, bias, compute_dtype=compute
        )
    elif w.backend == "vnni":
        assert w.vnni is not None
        y = vnni_matmul(x2, w.vnni).to(x.dtype)
        y = y if bias is None else y + bias
    elif w.backend == "int4pack":
        assert w.scales is not None
        xc = x2.to(w.compute_dtype).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(xc, w.qweight, w.group_size, w.scales)
        if y.shape[1] != w.out_features:  # rows padded to a multiple of 16 at prepare
            y = y[:, : w.out_features].contiguous()
        y = y.to(x.dtype)
        y = y if bias is None else y + bias
    else:
        weight = w.qweight if w.backend == "dense" else _dequantize_now(w)
        y = F.linear(x2.to(w.compute_dtype), weight, _cast(bias, w.compute_dtype)).to(x.dtype)
    return y.reshape(*lead, w.out_features)


def _dequantize_now(w: W4A16Weights) -> torch.Tensor:
    assert w.scales is not None and w.zeros is not None
    kn = _dequantize_kn(w.qweight, w.scales, w.zeros, w.g_idx, w.group_size)
    return kn.to(w.compute_dtype).t()


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)
