"""Quantized matmuls (int4 w4a16, int8 w8a16): the references against a per-element loop, and
every backend against dequantize + ``F.linear``.

Tolerances: float32 paths (exact dequantization, float32 accumulation) must agree with float32
``F.linear`` on the reference weight to rounding (rtol 1e-5, atol 1e-5 of the output's
largest magnitude). bf16/fp16 paths (weights and activations rounded to 16 bits, output
rounded to 16 bits) must agree within 1e-2 of the output's largest magnitude.

Triton kernels run under the CPU interpreter (small tiles, tiny shapes: it is slow) in float32
and fp16: Triton 3.6's interpreter computes bf16 dots from raw bits (garbage), so bf16 runs
only in the compiled ``gpu`` tests. ``test_triton_kernels_compile_for_sm90`` checks that the
kernels lower to a Hopper cubin without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenwire.kernels.quant_matmul import (
    Backend,
    choose_backend,
    dequantize_w4a16,
    dequantize_w8a16,
    pack_int4,
    prepare_w4a16,
    prepare_w8a16,
    unpack_int4,
    w4a16_matmul,
    w8a16_matmul,
)
from tokenwire.kernels.quant_matmul_triton import (
    Tiles,
    w4a16_matmul_triton,
    w8a16_matmul_triton,
)

ON_CUDA = torch.cuda.is_available()


DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
SMALL = Tiles(16, 16, 128, split_k=1)  # the smallest tiles that also compile (dot depth 16)
CPU = torch.device("cpu")
f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16


def int4_weight(
    k: int, n: int, group_size: int, act_order: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random canonical int4 weights: all 16 codes, asymmetric non-integer zeros, and an
    optional act-order ``g_idx`` (each group's rows scattered over K, as GPTQ writes it)."""
    gen = torch.Generator().manual_seed(seed)
    qweight = pack_int4(torch.randint(0, 16, (k, n), generator=gen))
    groups = -(-k // group_size)
    scales = torch.rand(groups, n, generator=gen) * 0.02 + 0.005
    zeros = torch.rand(groups, n, generator=gen) * 15
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group_size)[torch.randperm(k, generator=gen)].int()
    return qweight, scales, zeros, g_idx


def int8_weight(k: int, n: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return codes, torch.rand(n, k // group_size, generator=gen) * 0.002 + 0.0005


def activations(m: int, k: int, dtype: torch.dtype = f32, seed: int = 2) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """float32 ``F.linear`` on inputs rounded to ``dtype`` (the dequantize + F.linear path)."""
    b = None if bias is None else bias.to(dtype).float()
    return F.linear(x.to(dtype).float(), weight.to(dtype).float(), b)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    scale = ref.abs().max().item()
    if dtype == f32:
        torch.testing.assert_close(out.float(), ref, rtol=1e-5, atol=1e-5 * scale)
    else:
        err = (out.float() - ref).abs().max().item()
        assert err <= 1e-2 * scale, (err, scale)


# --- references ----------------------------------------------------------------------------


def test_pack_unpack_round_trip_includes_the_sign_nibble() -> None:
    codes = torch.randint(0, 16, (32, 5), generator=torch.Generator().manual_seed(3))
    codes[7::8, 0] = 15  # nibble 7 = 15 sets the int32 sign bit
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (4, 5) and bool((packed < 0).any())
    assert torch.equal(unpack_int4(packed), codes.int())


@pytest.mark.parametrize("act_order", [False, True])
def test_dequantize_w4a16_matches_per_element_loop(act_order: bool) -> None:
    k, n, group_size = 24, 3, 8
    qweight, scales, zeros, g_idx = int4_weight(k, n, group_size, act_order)
    out = dequantize_w4a16(qweight, scales, zeros, g_idx, group_size)
    assert out.shape == (n, k) and out.dtype == f32
    for row in range(n):
        for col in range(k):
            code = (int(qweight[col // 8, row]) >> (4 * (col % 8))) & 0xF
            g = int(g_idx[col]) if g_idx is not None else col // group_size
            want = (torch.tensor(float(code)) - zeros[g, row]) * scales[g, row]
            assert out[row, col] == want, (row, col)


def test_dequantize_w8a16_matches_per_element_loop() -> None:
    codes, scales = int8_weight(12, 3, 4)
    out = dequantize_w8a16(codes, scales, 4)
    for row in range(3):
        for col in range(12):
            assert out[row, col] == float(codes[row, col]) * scales[row, col // 4]


def test_prepare_rejects_malformed_layouts() -> None:
    qweight, scales, zeros, _ = int4_weight(64, 16, 32)
    with pytest.raises(ValueError, match="group_size"):
        prepare_w4a16(qweight, scales, zeros, None, 64, CPU, f32)
    with pytest.raises(ValueError, match="scales/zeros"):
        prepare_w4a16(qweight, scales[:, :8], zeros, None, 32, CPU, f32)
    with pytest.raises(ValueError, match="g_idx"):
        prepare_w4a16(qweight, scales, zeros, torch.full((64,), 2, dtype=torch.int32), 32, CPU, f32)
    codes, s8 = int8_weight(64, 16, 32)
    with pytest.raises(ValueError, match="scales"):
        prepare_w8a16(codes, s8, 16, CPU, f32)


# --- torch CPU backends --------------------------------------------------------------------

# (backend, activation dtype, compute dtype): every CPU path, including the opt-in bf16
# matmul for a float32 model.
CPU_INT4 = [
    ("int4pack", bf16, None),
    ("int4pack", f16, None),
    ("int4pack", f32, bf16),
    ("dense", f32, None),
    ("dense", f16, None),
    ("dequant", f32, None),
    ("dequant", bf16, None),
]


@pytest.mark.parametrize(("backend", "dtype", "compute"), CPU_INT4, ids=str)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("act_order", [False, True])
def test_cpu_w4a16_backends_match_dequantize_linear(
    backend: Backend,
    dtype: torch.dtype,
    compute: torch.dtype | None,
    group_size: int,
    act_order: bool,
) -> None:
    k, n = 256, 40  # N = 40: the int4pack path pads to 48 rows
    qweight, scales, zeros, g_idx = int4_weight(k, n, group_size, act_order)
    scales, zeros = scales.to(dtype), zeros.to(dtype)  # loaders pass them in the model dtype
    weight = dequantize_w4a16(qweight, scales, zeros, g_idx, group_size)
    bias = torch.randn(n).to(dtype)
    prepared = prepare_w4a16(
        qweight,
        scales,
        zeros,
        g_idx,
        group_size,
        CPU,
        dtype,
        compute_dtype=compute,
        backend=backend,
    )
    assert prepared.backend == backend
    assert (prepared.perm is not None) == (act_order and backend != "dense")
    for m in (1, 3, 17):
        x = activations(m, k, dtype, seed=m)
        out = w4a16_matmul(x, prepared, bias if m == 3 else None)
        assert out.dtype == dtype and out.shape == (m, n)
        assert_matches(
            out, linear_ref(x, weight, bias if m == 3 else None, compute or dtype), compute or dtype
        )


def test_per_channel_int4_uses_int4pack_with_repeated_scales() -> None:
    k, n = 192, 32  # one group of 192: int4pack runs it as three groups of 64
    qweight, scales, zeros, _ = int4_weight(k, n, k)
    prepared = prepare_w4a16(qweight, scales.to(bf16), zeros.to(bf16), None, k, CPU, bf16)
    assert prepared.backend == "int4pack" and prepared.group_size == 64
    x = activations(5, k, bf16)
    weight = dequantize_w4a16(qweight, scales.to(bf16), zeros.to(bf16), None, k)
    assert_matches(w4a16_matmul(x, prepared), linear_ref(x, weight, None, bf16), bf16)


@pytest.mark.parametrize("backend", [None, "dequant"])
def test_irregular_g_idx_on_cpu(backend: Backend | None) -> None:
    """Groups of unequal size cannot be sorted into torch's fixed-size packed groups: the
    default is the dense copy; the per-call dequantization reads ``g_idx`` as it is."""
    k, n = 128, 32
    qweight, scales, zeros, _ = int4_weight(k, n, 32)
    g_idx = torch.randint(0, 4, (k,), generator=torch.Generator().manual_seed(4)).int()
    scales, zeros = scales.to(bf16), zeros.to(bf16)
    prepared = prepare_w4a16(qweight, scales, zeros, g_idx, 32, CPU, bf16, backend=backend)
    assert prepared.backend == (backend or "dense") and prepared.perm is None
    assert (prepared.g_idx is not None) == (backend == "dequant")
    x = activations(3, k, bf16)
    weight = dequantize_w4a16(qweight, scales, zeros, g_idx, 32)
    assert_matches(w4a16_matmul(x, prepared), linear_ref(x, weight, None, bf16), bf16)


def test_backend_choice_by_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert choose_backend(CPU, bf16, cpu_packable=True) == "int4pack"
    assert choose_backend(CPU, f16, cpu_packable=True) == "dense"  # torch's fp16 loop is slow
    assert choose_backend(CPU, bf16, cpu_packable=False) == "dense"
    assert choose_backend(CPU, f32, cpu_packable=True) == "dense"
    qweight, scales, zeros, _ = int4_weight(128, 32, 64)
    assert prepare_w4a16(qweight, scales, zeros, None, 64, CPU, f32).backend == "dense"
    codes, s8 = int8_weight(128, 32, 128)
    assert prepare_w8a16(codes, s8.to(bf16), 128, CPU, bf16).backend == "int8pack"
    assert prepare_w8a16(codes, s8, 128, CPU, f32).backend == "dense"
    grouped, s8g = int8_weight(128, 32, 32)
    assert prepare_w8a16(grouped, s8g.to(bf16), 32, CPU, bf16).backend == "dense"
    fp32_bf16 = prepare_w4a16(qweight, scales, zeros, None, 64, CPU, f32, compute_dtype=bf16)
    assert fp32_bf16.backend == "int4pack" and fp32_bf16.compute_dtype == bf16
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose_backend(CPU, f32, cpu_packable=True) == "triton"


CPU_INT8 = [("int8pack", bf16, 0), ("int8pack", f32, bf16), ("dense", f32, 0), ("dequant", f32, 32),
            ("dequant", bf16, 64), ("dense", bf16, 32)]  # fmt: skip


@pytest.mark.parametrize(("backend", "dtype", "compute"), CPU_INT8, ids=str)
def test_cpu_w8a16_backends_match_dequantize_linear(
    backend: Backend, dtype: torch.dtype, compute: torch.dtype | int
) -> None:
    """``compute``: a dtype = the matmul's; an int = a group size (0: per channel)."""
    k, n = 128, 24
    group_size = compute if isinstance(compute, int) and compute else k
    compute_dtype = compute if isinstance(compute, torch.dtype) else None
    codes, scales = int8_weight(k, n, group_size)
    scales = scales.to(dtype)
    weight = dequantize_w8a16(codes, scales, group_size)
    prepared = prepare_w8a16(
        codes, scales, group_size, CPU, dtype, compute_dtype=compute_dtype, backend=backend
    )
    bias = torch.randn(n).to(dtype)
    for m in (1, 3, 17):
        x = activations(m, k, dtype, seed=m)
        out = w8a16_matmul(x, prepared, bias)
        assert out.dtype == dtype and out.shape == (m, n)
        assert_matches(
            out, linear_ref(x, weight, bias, compute_dtype or dtype), compute_dtype or dtype
        )


def test_leading_dims_are_kept() -> None:
    qweight, scales, zeros, _ = int4_weight(64, 16, 32)
    prepared = prepare_w4a16(qweight, scales, zeros, None, 32, CPU, f32)
    x = activations(6, 64).view(2, 3, 64)
    out = w4a16_matmul(x, prepared)
    assert out.shape == (2, 3, 16)
    assert torch.equal(out.view(6, 16), w4a16_matmul(x.view(6, 64), prepared))
    assert w4a16_matmul(x[:0], prepared).shape == (0, 3, 16)


# --- Triton (interpreter on CPU, compiled on CUDA) -----------------------------------------


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter switch for one Triton test: Triton reads it again at launch, and
    ``prepare`` picks the Triton backend on CPU only while it is set. The CPU-backend tests
    above run without it."""
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def on_device(g_idx: torch.Tensor | None) -> torch.Tensor | None:
    return None if g_idx is None else g_idx.to(DEVICE)


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("mode", ["plain", "act_order", "g_idx"])
def test_triton_w4a16_matches_dequantize_linear(group_size: int, mode: str) -> None:
    """plain: K-ordered groups (128: one scale row per K tile; 32/64: gathered per row);
    act_order: sorted once by ``prepare``, ``x`` gathered per call; g_idx: the kernel reads
    ``g_idx`` per row. N = 40 leaves a ragged N tile; M = 17 a ragged M tile; split-K = 2."""
    k, n = 256, 40
    qweight, scales, zeros, g_idx = int4_weight(k, n, group_size, mode != "plain")
    weight = dequantize_w4a16(qweight, scales, zeros, g_idx, group_size)
    bias = torch.randn(n)
    if mode == "act_order":
        prepared = prepare_w4a16(qweight, scales, zeros, g_idx, group_size, DEVICE, f32,
                                 backend="triton")  # fmt: skip
        assert prepared.perm is not None and prepared.g_idx is None
    for m, tiles in ((1, SMALL), (17, Tiles(16, 16, 128, split_k=2))):
        x = activations(m, k, seed=m)
        if mode == "act_order":
            out = w4a16_matmul(x.to(DEVICE), prepared, bias.to(DEVICE))
        else:
            out = w4a16_matmul_triton(
                x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE),
                on_device(g_idx), group_size, bias.to(DEVICE), tiles=tiles,
            )  # fmt: skip
        assert out.shape == (m, n) and out.dtype == f32
        assert_matches(out.cpu(), linear_ref(x, weight, bias, f32), f32)


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize(("k", "group_size"), [(200, 200), (192, 64)])
def test_triton_w4a16_ragged_k_tile(k: int, group_size: int) -> None:
    """K not a multiple of BLOCK_K: a per-channel weight (one scale row for every tile) and
    64-row groups (per-row scales), both with a half-masked last tile."""
    n = 16
    qweight, scales, zeros, _ = int4_weight(k, n, group_size)
    x = activations(3, k)
    out = w4a16_matmul_triton(
        x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), None, group_size,
        tiles=SMALL,
    )  # fmt: skip
    weight = dequantize_w4a16(qweight, scales, zeros, None, group_size)
    assert_matches(out.cpu(), linear_ref(x, weight, None, f32), f32)


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize(("dtype", "compute"), [(f16, None), (f32, f16)])
def test_triton_w4a16_half_precision(dtype: torch.dtype, compute: torch.dtype | None) -> None:
    """fp16 activations and scales; and a float32 model running fp16 dots (``compute_dtype``)."""
    k, n = 256, 48
    qweight, scales, zeros, g_idx = int4_weight(k, n, 64, act_order=True)
    scales, zeros = scales.to(dtype), zeros.to(dtype)
    prepared = prepare_w4a16(qweight, scales, zeros, g_idx, 64, DEVICE, dtype,
                             compute_dtype=compute, backend="triton")  # fmt: skip
    x, bias = activations(5, k, dtype), torch.randn(n).to(dtype)
    out = w4a16_matmul(x.to(DEVICE), prepared, bias.to(DEVICE))
    assert out.dtype == dtype
    weight = dequantize_w4a16(qweight, scales, zeros, g_idx, 64)
    assert_matches(out.cpu(), linear_ref(x, weight, bias, compute or dtype), f16)


@pytest.mark.usefixtures("interpret")
def test_triton_w4a16_irregular_g_idx_through_prepare() -> None:
    k, n = 128, 16
    qweight, scales, zeros, _ = int4_weight(k, n, 32)
    g_idx = torch.randint(0, 4, (k,), generator=torch.Generator().manual_seed(4)).int()
    prepared = prepare_w4a16(qweight, scales, zeros, g_idx, 32, DEVICE, f32, backend="triton")
    assert prepared.g_idx is not None and prepared.perm is None
    assert w4a16_matmul(torch.empty(0, k, device=DEVICE), prepared).shape == (0, n)
    x = activations(2, k)
    weight = dequantize_w4a16(qweight, scales, zeros, g_idx, 32)
    assert_matches(
        w4a16_matmul(x.to(DEVICE), prepared).cpu(), linear_ref(x, weight, None, f32), f32
    )


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("group_size", [32, 128, 384])
def test_triton_w8a16_matches_dequantize_linear(group_size: int) -> None:
    """32: per-row scales inside a K tile; 128: one scale per tile (applied after the dot);
    384 = K: per channel. K = 384 is three tiles; split-K = 2 leaves one split a single tile."""
    k, n = 384, 40
    codes, scales = int8_weight(k, n, group_size)
    weight = dequantize_w8a16(codes, scales, group_size)
    bias = torch.randn(n)
    for m, tiles in ((1, SMALL), (17, Tiles(16, 16, 128, split_k=2))):
        x = activations(m, k, seed=m)
        out = w8a16_matmul_triton(
            x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), group_size, bias.to(DEVICE),
            tiles=tiles,
        )  # fmt: skip
        assert_matches(out.cpu(), linear_ref(x, weight, bias, f32), f32)


@pytest.mark.usefixtures("interpret")
def test_triton_w8a16_with_minimums() -> None:
    """GGUF K-quants' ``W = code * scale + min`` (scales per 16, minimums per 32, codes 0..31
    as Q5_K's): against the float32 linear over the de-quantized weight, decode and a ragged
    M tile with split-K."""
    k, n = 256, 40
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 32, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // 16, generator=gen) * 0.01
    mins = -torch.rand(n, k // 32, generator=gen) * 0.1
    weight = codes.float().view(n, k // 16, 16) * scales[..., None]
    weight = (weight.view(n, k // 32, 32) + mins[..., None]).view(n, k)
    bias = torch.randn(n)
    for m, tiles in ((1, SMALL), (17, Tiles(16, 16, 128, split_k=2))):
        x = activations(m, k, seed=m)
        out = w8a16_matmul_triton(
            x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), 16, bias.to(DEVICE),
            mins=mins.to(DEVICE), tiles=tiles,
        )  # fmt: skip
        assert_matches(out.cpu(), linear_ref(x, weight, bias, f32), f32)


@pytest.mark.usefixtures("interpret")
def test_triton_w8a16_fp16_through_prepare() -> None:
    k, n = 256, 32
    codes, scales = int8_weight(k, n, 64)
    prepared = prepare_w8a16(codes, scales.half(), 64, DEVICE, f16, backend="triton")
    x = activations(4, k, f16)
    out = w8a16_matmul(x.to(DEVICE), prepared)
    weight = dequantize_w8a16(codes, scales.half(), 64)
    assert out.dtype == f16
    assert_matches(out.cpu(), linear_ref(x, weight, None, f16), f16)


@pytest.mark.skipif(ON_CUDA, reason="CPU dispatch")
@pytest.mark.usefixtures("interpret")
def test_interpreter_switch_routes_prepare_to_triton() -> None:
    qweight, scales, zeros, _ = int4_weight(128, 16, 128)
    prepared = prepare_w4a16(qweight, scales, zeros, None, 128, CPU, f32)
    assert prepared.backend == "triton"
    x = activations(1, 128)
    weight = dequantize_w4a16(qweight, scales, zeros, None, 128)
    assert_matches(w4a16_matmul(x, prepared), linear_ref(x, weight, None, f32), f32)


_COMPILE_CHECK = """
import importlib.util, sys, torch
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction
spec = importlib.util.spec_from_file_location("check", sys.argv[1])
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
check._PTR_TYPES.update({torch.int8: "i8", torch.float16: "fp16"})
launches = []
JITFunction.__getitem__ = lambda self, grid: lambda *a, **k: launches.append((self, a, k))
from tokenwire.kernels.quant_matmul_triton import w4a16_matmul_triton, w8a16_matmul_triton
bf16, k, n = torch.bfloat16, 4096, 4096
qw = torch.empty(k // 8, n, dtype=torch.int32)
s = torch.empty(k // 128, n, dtype=bf16)
q8 = torch.empty(n, k, dtype=torch.int8)
for m in (1, 64, 256):  # the three tile buckets
    x = torch.empty(m, k, dtype=bf16)
    w4a16_matmul_triton(x, qw, s, s, None, 128, x[0, :n])
    w8a16_matmul_triton(x, q8, torch.empty(n, 32, dtype=bf16), 128, None)
w4a16_matmul_triton(x[:1], qw, s, s, torch.empty(k, dtype=torch.int32), 128, None)
w8a16_matmul_triton(x[:1], q8, torch.empty(n, 128, dtype=bf16), 32, x[0, :n])
w4a16_matmul_triton(torch.empty(3, k), qw, s, s, None, 32, None)  # float32: IEEE dots
f32 = torch.float32  # GGUF K-quants: float32 scales per 16 and minimums per 32
for m in (1, 64):
    w8a16_matmul_triton(torch.empty(m, k, dtype=bf16), q8, torch.empty(n, k // 16, dtype=f32),
                        16, None, mins=torch.empty(n, k // 32, dtype=f32))
for launch in launches:
    check.compile_launch(launch, GPUTarget("cuda", 90, 32))
"""


def test_triton_kernels_compile_for_sm90() -> None:
    """bf16 decode/prefill tiles, g_idx, per-row and per-tile scales, float32 IEEE dots, GGUF
    K-quant minimums: each
    launch lowers to a cubin for sm_90 (the compile helper of ``triton_compile_check.py``)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    helper = str(Path(__file__).with_name("triton_compile_check.py"))
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_CHECK, helper],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]


# --- GPU: compiled, bf16, model shapes -----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize(("n", "k", "group_size", "act_order"),
                         [(4096, 4096, 128, False), (14336, 4096, 128, True), (576, 1536, 64, True),
                          (960, 576, 576, False)])  # fmt: skip
def test_gpu_w4a16_bf16(m: int, n: int, k: int, group_size: int, act_order: bool) -> None:
    qweight, scales, zeros, g_idx = int4_weight(k, n, group_size, act_order)
    scales, zeros = scales.to(bf16), zeros.to(bf16)
    prepared = prepare_w4a16(qweight, scales, zeros, g_idx, group_size, DEVICE, bf16)
    assert prepared.backend == "triton"
    x = activations(m, k, bf16)
    weight = dequantize_w4a16(qweight, scales, zeros, g_idx, group_size)
    out = w4a16_matmul(x.to(DEVICE), prepared)
    assert_matches(out.cpu(), linear_ref(x, weight, None, bf16), bf16)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("group_size", [128, 4096])
def test_gpu_w8a16_bf16_and_cuda_graph(group_size: int) -> None:
    """Model shapes, and a captured graph replays the same launch on new activations."""
    k, n = 4096, 4096
    codes, scales = int8_weight(k, n, group_size)
    prepared = prepare_w8a16(codes, scales.to(bf16), group_size, DEVICE, bf16)
    assert prepared.backend == "triton"
    weight = dequantize_w8a16(codes, scales.to(bf16), group_size)
    x = activations(8, k, bf16).to(DEVICE)
    w8a16_matmul(x, prepared)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w8a16_matmul(x, prepared)
    x.copy_(activations(8, k, bf16, seed=9).to(DEVICE))
    graph.replay()
    assert_matches(out.cpu(), linear_ref(x.cpu(), weight, None, bf16), bf16)
