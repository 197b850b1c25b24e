"""The fused MoE over MXFP4 experts (``kernels.moe_mxfp4_triton``, gpt-oss kept quantized)
against the torch reference ``fused_moe_ref`` over the ``dequantize_mxfp4`` weights: biases
with and without the down bias, ``swigluoai`` and SiLU, top-k 1 to 3, token counts off the
tile grid, random codes (every nibble incl. -0.0) and scales incl. the extreme exponents 0, 1,
253 and 254 (the input scaled per 32-block so the products stay finite).

Without CUDA the kernel runs under Triton's CPU interpreter on small float32 shapes with
16-row tiles (the kernels are defined interpreted by the root conftest).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenwire.kernels.moe import fused_moe_mxfp4, fused_moe_ref, select_experts
from tokenwire.kernels.moe_mxfp4_triton import fused_moe_mxfp4_triton
from tokenwire.kernels.moe_triton import MoETiles
from tokenwire.runtime.models.mxfp4 import dequantize_mxfp4

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
SMALL_TILES = MoETiles(16, 16, 32)
ALPHA, LIMIT = 1.702, 1.5  # a limit low enough that both clamps bite
EXTREMES = (0, 1, 2, 60, 127, 200, 253, 254)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _pair(
    gen: torch.Generator, rows: int, k: int, e: int, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 ``[e, rows, k/32, 16]`` codes and ``[e, rows, k/32]`` scales (given, or
    random around 2 ** -3 so the outputs stay O(1)); blocks scaled by 253/254 keep |v| < 2."""
    blocks = torch.randint(0, 256, (e, rows, k // 32, 16), generator=gen, dtype=torch.uint8)
    if scales is None:
        scales = torch.randint(120, 126, (e, rows, k // 32), generator=gen, dtype=torch.uint8)
    blocks[scales >= 253] &= 0xBB  # clear each nibble's top exponent bit: |v| <= 1.5
    return blocks, scales


def _operands(
    t: int, h: int, inter: int, e: int, k: int, seed: int, extreme: bool = False
) -> tuple[torch.Tensor, ...]:
    """(x, w13 blocks, w13 scales, w2 blocks, w2 scales, b13, b2, weights, ids). ``extreme``:
    gate_up's k-th 32-block has scale ``EXTREMES[k]`` in every row and x's k-th block is
    scaled by ``2 ** (126 - scale)`` (so each block's products are O(1))."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(t, h, generator=gen) * 2 - 1
    scales13 = None
    if extreme:
        per_block = torch.tensor(EXTREMES, dtype=torch.uint8).repeat(h // 32 // len(EXTREMES))
        scales13 = per_block.expand(e, 2 * inter, h // 32).contiguous()
        x = x * torch.pow(2.0, 126 - per_block.double()).repeat_interleave(32).float()
    w13 = _pair(gen, 2 * inter, h, e, scales13)
    w2 = _pair(gen, h, inter, e)
    b13 = torch.randn(e, 2 * inter, generator=gen)
    b2 = torch.randn(e, h, generator=gen)
    logits = torch.randn(t, e, generator=gen) * 2
    weights, ids = select_experts(logits, k, renormalize=False, softmax_after_topk=True)
    out = (x, *w13, *w2, b13, b2, weights, ids)
    return tuple(v.to(DEVICE) for v in out)


def _dequantized(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp4(blocks.cpu(), scales.cpu()).to(DEVICE)


# (tokens, hidden, intermediate, experts, top-k)
SHAPES = [
    (1, 64, 32, 4, 2),  # one token: most experts get nothing
    (9, 64, 96, 6, 1),  # intermediate off the 16-tile grid, top-1
    (21, 32, 64, 4, 3),  # several row blocks per expert
]


@pytest.mark.parametrize("down_bias", [True, False])
@pytest.mark.parametrize(("t", "h", "inter", "e", "k"), SHAPES)
def test_swigluoai_with_biases_matches_the_dequantized_reference(
    t: int, h: int, inter: int, e: int, k: int, down_bias: bool
) -> None:
    """The kernel (small tiles) and the public dispatch (default tiles) equal ``fused_moe_ref``
    over the de-quantized weights; the clamp bites."""
    x, b13q, s13, b2q, s2, b13, b2, weights, ids = _operands(t, h, inter, e, k, seed=t + e)
    w13, w2 = _dequantized(b13q, s13), _dequantized(b2q, s2)
    kw = dict(biases=(b13, b2 if down_bias else None), swiglu=(ALPHA, LIMIT))
    ref = fused_moe_ref(x, w13, w2, weights, ids, "swigluoai", **kw)
    got = fused_moe_mxfp4_triton(
        x, (b13q, s13), (b2q, s2), weights, ids, "swigluoai", tiles=SMALL_TILES, **kw
    )
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    dispatched = fused_moe_mxfp4(x, (b13q, s13), (b2q, s2), weights, ids, "swigluoai", **kw)
    torch.testing.assert_close(dispatched, ref, atol=2e-5, rtol=1e-5)
    assert ((torch.einsum("th,eih->tei", x, w13) + b13).abs() > LIMIT).any()


def test_extreme_scales_decode_exactly() -> None:
    """Every gate_up row holds blocks scaled by 2 ** -127 (the subnormal scale 0), 2 ** -126,
    2 ** 126 and 2 ** 127 among others; x undoes each block's scale, so a wrongly decoded
    block (or a flushed subnormal) would change the result by O(1)."""
    x, b13q, s13, b2q, s2, b13, b2, weights, ids = _operands(5, 256, 32, 3, 2, 3, extreme=True)
    w13, w2 = _dequantized(b13q, s13), _dequantized(b2q, s2)
    assert (w13[w13 != 0].abs().min() < 2.0**-126) and w13.abs().max() >= 2.0**126
    kw = dict(biases=(b13, b2), swiglu=(ALPHA, 7.0))
    ref = fused_moe_ref(x, w13, w2, weights, ids, "swigluoai", **kw)
    got = fused_moe_mxfp4_triton(
        x, (b13q, s13), (b2q, s2), weights, ids, "swigluoai", tiles=SMALL_TILES, **kw
    )
    assert torch.isfinite(ref).all() and ref.abs().max() > 0.1
    # Outputs up to ~270: float32 sums in another order differ by ~1e-7 relative.
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
    scrambled = s13.clone()
    scrambled[..., 0] = 1  # 2 ** -126 instead of 2 ** -127 in the first block of every row
    wrong = fused_moe_mxfp4_triton(
        x, (b13q, scrambled), (b2q, s2), weights, ids, "swigluoai", tiles=SMALL_TILES, **kw
    )
    assert (wrong - ref).abs().max() > 1e-2


def test_silu_without_biases() -> None:
    x, b13q, s13, b2q, s2, _, _, weights, ids = _operands(12, 64, 32, 4, 2, seed=7)
    w13, w2 = _dequantized(b13q, s13), _dequantized(b2q, s2)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    got = fused_moe_mxfp4_triton(x, (b13q, s13), (b2q, s2), weights, ids, tiles=SMALL_TILES)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_interleaved_rows_as_the_checkpoint_stores_them() -> None:
    """gate_up rows in the checkpoint's order (gate, up, gate, up, ...) with ``interleaved``
    equal the reference over the de-interleaved weights (gate half, then up half)."""
    x, b13q, s13, b2q, s2, b13, b2, weights, ids = _operands(10, 64, 64, 4, 2, seed=11)
    w13, w2 = _dequantized(b13q, s13), _dequantized(b2q, s2)
    inter = w13.shape[1] // 2
    order = torch.stack((torch.arange(inter), torch.arange(inter) + inter), dim=1).flatten()
    stored = (b13q[:, order].contiguous(), s13[:, order].contiguous())  # gate, up, gate, ...
    kw = dict(biases=(b13, b2), swiglu=(ALPHA, LIMIT))
    ref = fused_moe_ref(x, w13, w2, weights, ids, "swigluoai", **kw)
    got = fused_moe_mxfp4(x, stored, (b2q, s2), weights, ids, "swigluoai", **kw, interleaved=True)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    flat = fused_moe_mxfp4(x, stored, (b2q, s2), weights, ids, "swigluoai", **kw)
    assert (flat - ref).abs().max() > 1e-2


def test_bad_operands_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    x, b13q, s13, b2q, s2, b13, b2, weights, ids = _operands(3, 64, 32, 4, 2, seed=2)
    w13, w2 = (b13q, s13), (b2q, s2)
    with pytest.raises(ValueError, match="MXFP4 down must be uint8"):
        fused_moe_mxfp4_triton(x, w13, (b2q[:, :16], s2), weights, ids)
    with pytest.raises(ValueError, match="MXFP4 gate_up must be uint8"):
        fused_moe_mxfp4_triton(x, (b13q.to(torch.int32), s13), w2, weights, ids)
    with pytest.raises(ValueError, match="biases must be"):
        fused_moe_mxfp4_triton(x, w13, w2, weights, ids, biases=(b13[:, :16], b2))
    with pytest.raises(ValueError, match="block_k a multiple of 32"):
        fused_moe_mxfp4_triton(x, w13, w2, weights, ids, tiles=MoETiles(16, 16, 16))
    with pytest.raises(ValueError, match="needs swiglu"):
        fused_moe_mxfp4(x, w13, w2, weights, ids, "swigluoai")
    if not ON_CUDA:
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="Triton only"):
            fused_moe_mxfp4(x, w13, w2, weights, ids, "silu")


_COMPILE_CHECK = """
import importlib.util, sys
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction
spec = importlib.util.spec_from_file_location("check", sys.argv[1])
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
launches = []
JITFunction.__getitem__ = lambda self, grid: lambda *a, **k: launches.append((self, a, k))
check._moe_mxfp4_launches()
assert {fn.__name__ for fn, _, _ in launches} == {"_gate_up_mxfp4_kernel", "_down_mxfp4_kernel"}
for launch in launches:
    check.compile_launch(launch, GPUTarget("cuda", 90, 32))
"""


def test_kernels_compile_for_sm90() -> None:
    """gpt-oss-20b's MXFP4 experts (bf16, decode and prefill tiles, with and without the down
    bias, interleaved gate/up rows) and a float32 tiny model lower to a cubin for sm_90 within
    its shared memory (``triton_compile_check._moe_mxfp4_launches``, also in the full check)."""
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


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 1024])
def test_gpu_bf16_gpt_oss_20b_shapes(t: int) -> None:
    """gpt-oss-20b's experts (H = I = 2880, top-4 of 32) in bf16 with default tiles, against
    the float32 reference on the de-quantized weights (exact in bf16)."""
    x, b13q, s13, b2q, s2, b13, b2, weights, ids = _operands(t, 2880, 2880, 32, 4, seed=t)
    w13, w2 = _dequantized(b13q, s13), _dequantized(b2q, s2)
    bf16 = [v.to(torch.bfloat16) for v in (x, b13, b2)]
    kw = dict(swiglu=(ALPHA, 7.0))
    got = fused_moe_mxfp4(
        bf16[0], (b13q, s13), (b2q, s2), weights, ids, "swigluoai", (bf16[1], bf16[2]), **kw
    )
    f32 = [v.float() for v in bf16]
    ref = fused_moe_ref(f32[0], w13, w2, weights, ids, "swigluoai", (f32[1], f32[2]), **kw)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 2e-2
