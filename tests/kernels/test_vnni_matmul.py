"""``kernels.vnni_matmul`` / ``kernels.int8_logits``: the AVX-512 VNNI int4 / int8 CPU matmuls.

The layouts round-trip exactly; outputs are within a stated bound of the float64 product of
the de-quantized weight (the activations' two-part int8 rounding keeps ~15 bits of each
32-block's largest value); a row's bits do not depend on the row count, the other rows or the
thread count; the int8 LM head gives back a Q8_0 tensor's own codes and refines its top
logits to the float32 values. Without the CPU features or a compiler the library reports why.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tokenwire.kernels.int8_logits import int8_logits, prepare_int8_logits, quantize_int8_blocks
from tokenwire.kernels.native_build import build_library
from tokenwire.kernels.vnni_matmul import (
    dequantize_vnni,
    pack_int4_vnni,
    pack_int8_vnni,
    vnni_matmul,
    vnni_status,
)
from tokenwire.kernels.w4a16 import pack_int4, prepare_w4a16, w4a16_matmul

pytestmark = pytest.mark.skipif(
    not vnni_status().loaded, reason=f"no VNNI kernel here: {vnni_status().reason}"
)
# |error| / max|reference| per output, measured ~5e-5 (torch's bf16-activation int4 kernel:
# ~3e-3 on the same data).
BOUND = 5e-4


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _int4(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    mins = (-8 * scales + torch.randn(n, k // 32, generator=g) * 1e-3).half().float()
    return codes, scales, mins


def _dense4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    blocks = codes.double().view(n, k // 32, 32) * scales.double()[..., None]
    return (blocks + mins.double()[..., None]).view(n, k)


def _activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * torch.rand(k, generator=g) * 4  # uneven channels


def _relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize(("n", "k"), [(200, 576), (48, 1536), (16, 32)])
def test_int4_round_trip_and_bound(n: int, k: int) -> None:
    codes, scales, mins = _int4(n, k)
    w = pack_int4_vnni(codes, scales, mins)
    dense = _dense4(codes, scales, mins)
    assert torch.equal(dequantize_vnni(w).double(), dense)  # exact layout, fp16 scales
    x = _activations(7, k)
    out = vnni_matmul(x, w)
    assert out.shape == (7, n) and out.dtype == torch.float32
    assert _relerr(out, x.double() @ dense.t()) < BOUND


def test_int8_round_trip_and_bound() -> None:
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(-128, 128, (72, 576), generator=g, dtype=torch.int8)
    scales = (torch.rand(72, 18, generator=g) * 0.01).half().float()
    w = pack_int8_vnni(codes, scales)
    dense = (codes.double().view(72, 18, 32) * scales.double()[..., None]).view(72, 576)
    assert torch.equal(dequantize_vnni(w).double(), dense)
    x = _activations(5, 576)
    assert _relerr(vnni_matmul(x, w), x.double() @ dense.t()) < BOUND


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_is_batch_and_thread_invariant(bits: int, threads: None) -> None:
    codes, scales, mins = _int4(96, 576)
    w = (
        pack_int4_vnni(codes, scales, mins)
        if bits == 4
        else pack_int8_vnni((codes - 8).to(torch.int8), scales)
    )
    x = _activations(37, 576)
    torch.set_num_threads(1)
    alone = [vnni_matmul(x[i : i + 1], w)[0] for i in (0, 5, 36)]
    torch.set_num_threads(2)
    for rows in (37, 16, 6):
        batch = vnni_matmul(x[:rows], w)
        for i, row in zip((0, 5, 36), alone, strict=True):
            if i < rows:
                assert torch.equal(batch[i], row), (bits, rows, i)


def test_w4a16_vnni_backend_matches_the_canonical_weight() -> None:
    codes, scales, mins = _int4(64, 256)
    zeros = -mins / scales  # canonical: W = (code - zero) * scale
    qweight = pack_int4(codes.t().contiguous())
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    args = (qweight, scales.t().contiguous(), zeros.t().contiguous(), None, 32, cpu)
    fast = prepare_w4a16(*args, torch.float32, compute_dtype=bf16, vnni=True)
    torch_kernel = prepare_w4a16(*args, torch.float32, compute_dtype=bf16)
    assert (fast.backend, torch_kernel.backend) == ("vnni", "int4pack")
    x = _activations(3, 256)
    ref = x.double() @ _dense4(codes, scales, mins).t()
    assert _relerr(w4a16_matmul(x, fast), ref) < BOUND
    bias = torch.randn(64)
    assert torch.allclose(w4a16_matmul(x, fast, bias), w4a16_matmul(x, fast) + bias)


def test_int8_head_recovers_q8_0_codes_and_refines_the_top_logits() -> None:
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (256, 64), generator=g, dtype=torch.int8)
    codes[:, 0] = 127  # Q8_0: each block's largest |code| is 127
    codes[:, 32] = -127
    scales = (torch.rand(256, 2, generator=g) * 0.01 + 1e-3).half().float()
    weight = (codes.float().view(256, 2, 32) * scales[..., None]).view(256, 64)
    got_codes, got_scales = quantize_int8_blocks(weight)
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales)
    head = prepare_int8_logits(weight, refine=4)
    x = _activations(6, 64)
    logits = int8_logits(x, head)
    exact = (weight.unsqueeze(0) * x.unsqueeze(1)).sum(-1)  # row by row, as the refinement
    top = exact.topk(4, dim=-1).indices
    assert torch.equal(logits.gather(1, top), exact.gather(1, top))
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    assert torch.equal(int8_logits(x[2:3], head)[0], logits[2])


def test_a_failed_build_is_a_reason_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENWIRE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    built = build_library("vnni_op.cpp", ("vnni_matmul.c",), ("-O3",))
    assert not built.loaded and "false" in built.reason
    monkeypatch.setenv("CXX", "c++")
    monkeypatch.setenv("TOKENWIRE_KERNEL_CACHE", str(tmp_path / "new"))
    bad = build_library("vnni_op.cpp", ("vnni_matmul.c",), ("-O3", "--no-such-flag"))
    assert not bad.loaded and "--no-such-flag" in bad.reason
    assert not list((tmp_path / "new").glob("*.so"))  # no half-written library left
