"""Int4 and int8 weight-quantized CPU matmuls on AVX-512 VNNI (``csrc/vnni_matmul.c``; the
torch operator ``tokenwire_vnni::matmul`` in ``csrc/vnni_op.cpp``, built by
``kernels.native_build``).

Torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) de-quantizes every weight to bf16
and multiplies in float32: on SmolLM2-135M's layers it ran at ~9 GB/s of int4 weights with
the weights already in cache (compute-bound), so one decode step's linears cost ~7 ms of CPU.
This path does what llama.cpp does for a Q4_1 x Q8_1 dot product: the activations are
quantized per 32-element block to int8 (scale ``amax / 127``), and each weight block's codes
meet them in integer dot products (``vpdpbusd``: 64 u8 x s8 products per instruction) that
are then scaled by the two blocks' scales. Measured, 1 thread, SmolLM2-135M's 30 layers of
linears per step (distinct weights, streamed from memory; docs/benchmarks.md): 1 row 6.2 ms
(torch int4: 6.5), 16 rows 25.7 ms (40.9), 128 rows 166 ms (320).

Layout (``pack_int4_vnni`` / ``pack_int8_vnni`` / ``pack_int8k_vnni``, made once at load): rows
in tiles of 16 (padded with zero rows), codes interleaved so one 64-byte load feeds 16 rows'
dot products over 4 (int8) or 8 (int4, two nibbles) elements; per-block scales (and int4's
minimums, ``W = scale * code + min``) as fp16, 16 rows side by side. ``pack_int8k_vnni`` (GGUF
Q8_0, Q6_K, Q5_K): int8 codes with float32 scales per 16 inputs (each half block's integer
dot scaled on its own) and optional float32 minimums per 32, so ``d * sc`` products that are
not fp16 values stay exact: the de-quantized weight equals ``gguf.quants.dequantize``'s.

Exactness: not the float32 path. The weights are the checkpoint's own codes (exact where the
scales and minimums are fp16 values, as GGUF's are). The activations are two int8 parts per
32-block, ``x ~ dx * (q1 + q2 / 254)``: llama.cpp's single part (q1) left errors of 1-1.5e-2
of a layer's largest output on the default model and moved greedy tokens; with the residual
q2 the error is 4-5e-5 (torch's bf16-activation int4 kernel: ~3e-3), for a second dot
product per weight load. Batch invariance holds: every output element is one fixed chain of
operations over K, whatever the row count, the other rows or the threads
(``tests/kernels/test_vnni_matmul.py``).

Needs x86-64 with AVX-512 (F, BW, VL, DQ, VNNI), F16C and FMA, read from ``/proc/cpuinfo``,
and a C++ compiler (``kernels.native_build``); ``vnni_status`` says why not otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenwire.kernels.native_build import NativeLibrary, build_library

BLOCK = 32
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma")
_CC_FLAGS = (
    "-O3", "-std=c++20", "-w", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
    "-mavx512vnni", "-mf16c", "-mfma", "-fopenmp",
)  # fmt: skip


@dataclass(frozen=True)
class VnniWeights:
    """One linear's weights in the kernel's layout: ``weight`` uint8 tiles, ``scales`` (and
    int4's ``mins``) fp16 tiles; ``out_features`` rows before padding to 16. ``scale_group``
    16: int8 codes with float32 scales per 16 inputs and float32 ``mins`` per 32 or none
    (``pack_int8k_vnni``, GGUF Q8_0 / Q5_K / Q6_K exactly)."""

    bits: int
    out_features: int
    in_features: int
    weight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    scale_group: int = BLOCK

    @property
    def mode(self) -> int:
        """The operator's ``bits``: 4 (int4), 8 (int8, fp16 scales per 32) or 16 (int8,
        float32 scales per 16)."""
        return self.bits if self.scale_group == BLOCK else 16


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def vnni_status() -> NativeLibrary:
    """The loaded operator library, or why this process has none (built and loaded once per
    process; the operator and its fake are registered with torch then)."""
    missing = [flag for flag in _CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        return NativeLibrary(reason=f"the CPU lacks {', '.join(missing)}")
    built = build_library("vnni_op.cpp", ("vnni_matmul.c", "fused_layers.c"), _CC_FLAGS)
    if built.loaded:
        torch.library.register_fake("tokenwire_vnni::matmul")(_matmul_fake)
    return built


def vnni_supported(in_features: int, group_size: int) -> bool:
    """Whether a linear with these shapes can take this path on this machine."""
    shapes = in_features % BLOCK == 0 and group_size % BLOCK == 0
    return shapes and vnni_status().loaded


def _tiles(values: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Per-group ``[N16, G]`` -> ``[N16 / 16, G, 16]`` in ``dtype`` (fp16 unless given)."""
    n16, blocks = values.shape
    return values.reshape(n16 // 16, 16, blocks).permute(0, 2, 1).to(dtype).contiguous()


def _pad_rows(t: torch.Tensor, value: float = 0) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, -t.shape[0] % 16), value=value)


def pack_int4_vnni(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> VnniWeights:
    """``codes`` [N, K] in [0, 16), ``scales``/``mins`` [N, K / 32]: W = scale * code + min.
    (Loads the operator library too, so ``vnni_matmul`` can run these weights.)"""
    vnni_status()
    n, k = codes.shape
    c = _pad_rows(codes.to(torch.uint8).cpu())
    c = c.reshape(-1, 16, k // 8, 2, 4).permute(0, 2, 1, 3, 4)  # tile, group, row, half, j
    packed = (c[..., 0, :] | (c[..., 1, :] << 4)).contiguous().reshape(-1)
    s, m = _pad_rows(scales.float().cpu()), _pad_rows(mins.float().cpu())
    return VnniWeights(4, n, k, packed, _tiles(s), _tiles(m))


def _pack_int8_codes(codes: torch.Tensor) -> torch.Tensor:
    k = codes.shape[1]
    shifted = (_pad_rows(codes.cpu().to(torch.int16)) + 128).to(torch.uint8)
    return shifted.reshape(-1, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous().reshape(-1)


def pack_int8_vnni(codes: torch.Tensor, scales: torch.Tensor) -> VnniWeights:
    """``codes`` [N, K] int8, ``scales`` [N, K / 32]: W = scale * code (loads the library)."""
    vnni_status()
    n, k = codes.shape
    packed = _pack_int8_codes(codes)
    return VnniWeights(8, n, k, packed, _tiles(_pad_rows(scales.float().cpu())), None)


def pack_int8k_vnni(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None
) -> VnniWeights:
    """``codes`` [N, K] int8, float32 ``scales`` [N, K / 16] or [N, K / 32] (spread to 16),
    ``mins`` [N, K / 32] or None: W = scale * code (+ min), the scales and minimums kept
    float32 (a K-quant's ``d * sc`` is not an fp16 value). Loads the library."""
    vnni_status()
    n, k = codes.shape
    s = scales.float().cpu()
    s = s.repeat_interleave(2, dim=1) if s.shape[1] == k // BLOCK else s
    m = None if mins is None else _tiles(_pad_rows(mins.float().cpu()), torch.float32)
    packed = _pack_int8_codes(codes)
    return VnniWeights(8, n, k, packed, _tiles(_pad_rows(s), torch.float32), m, 16)


def dequantize_vnni(w: VnniWeights) -> torch.Tensor:
    """The float32 ``[N, K]`` weight the kernel multiplies by (tests, references)."""
    k, blocks = w.in_features, w.in_features // BLOCK
    scales = w.scales.float().permute(0, 2, 1).reshape(-1, w.scales.shape[1])
    if w.mode == 16:
        codes = w.weight.reshape(-1, k // 4, 16, 4).permute(0, 2, 1, 3).reshape(-1, k)
        values = (codes.to(torch.int16) - 128).float().reshape(-1, k // 16, 16)
        dense = (values * scales[..., None]).reshape(-1, blocks, BLOCK)
        if w.mins is not None:
            dense = dense + w.mins.permute(0, 2, 1).reshape(-1, blocks)[..., None]
    elif w.bits == 8:
        codes = w.weight.reshape(-1, k // 4, 16, 4).permute(0, 2, 1, 3).reshape(-1, k)
        codes = codes.to(torch.int16) - 128
        dense = codes.float().reshape(-1, blocks, BLOCK) * scales[..., None]
    else:
        both = w.weight.reshape(-1, k // 8, 16, 4)
        lo, hi = both & 0xF, both >> 4
        codes = torch.cat([lo, hi], -1).permute(0, 2, 1, 3).reshape(-1, k)
        assert w.mins is not None
        mins = w.mins.float().permute(0, 2, 1).reshape(-1, blocks)
        dense = codes.float().reshape(-1, blocks, BLOCK) * scales[..., None] + mins[..., None]
    return dense.reshape(-1, k)[: w.out_features]


def vnni_matmul(x: torch.Tensor, w: VnniWeights) -> torch.Tensor:
    """``x [..., K] @ W.T -> [..., N]`` float32 (x is read as float32): one call of the
    operator ``tokenwire_vnni::matmul`` (opaque inside ``torch.compile`` graphs). Callers
    check ``vnni_supported`` first (not here: a cached call would split a compiled graph)."""
    lead, k = x.shape[:-1], w.in_features
    x2 = x.reshape(-1, k).to(torch.float32).contiguous()
    mins = w.mins if w.mins is not None else w.scales[:0] if w.mode == 16 else w.scales
    y: torch.Tensor = torch.ops.tokenwire_vnni.matmul.default(
        x2, w.weight, w.scales, mins, w.mode, w.out_features
    )
    return y.reshape(*lead, w.out_features)


def _matmul_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bits: int,
    out_features: int,
) -> torch.Tensor:
    """The operator's output shape, for ``torch.compile``'s tracing."""
    return x.new_empty(x.shape[0], out_features)
