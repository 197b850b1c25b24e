"""gpt-oss's experts in the fused-MoE Triton kernel: per-expert biases on gate_up [E, 2I] and
down [E, H] (down ``None`` on tensor-parallel ranks other than 0) and the clamped SwiGLU
``swigluoai``, against the torch reference (``kernels.moe.fused_moe_ref``), and the reference
against a float64 per-token oracle written from HF's ``GptOssExperts`` formula.

Without CUDA the kernel runs under Triton's CPU interpreter on small float32 shapes with
16-wide tiles (the kernels are defined interpreted by the root conftest).
"""

from __future__ import annotations

import pytest
import torch

from tokenwire.kernels.moe import fused_moe, fused_moe_ref, select_experts
from tokenwire.kernels.moe_triton import MoETiles, fused_moe_triton

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
SMALL_TILES = MoETiles(16, 16, 16)
ALPHA, LIMIT = 1.702, 1.5  # gpt-oss's alpha; a limit low enough that both clamps bite


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _operands(t: int, h: int, inter: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(x, w13, w2, b13, b2, weights, ids), routed as gpt-oss routes (softmax after top-k)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen) * 2
    w13 = torch.randn(e, 2 * inter, h, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, inter, generator=gen) * inter**-0.5
    b13 = torch.randn(e, 2 * inter, generator=gen)
    b2 = torch.randn(e, h, generator=gen)
    logits = torch.randn(t, e, generator=gen) * 2
    x, w13, w2, b13, b2, logits = (v.to(DEVICE) for v in (x, w13, w2, b13, b2, logits))
    weights, ids = select_experts(logits, k, renormalize=False, softmax_after_topk=True)
    return x, w13, w2, b13, b2, weights, ids


def _oracle(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor,
    b2: torch.Tensor | None,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """Token by token, slot by slot, in float64: HF's clamped SwiGLU on split gate/up."""
    x, w13, w2, b13, weights = (v.cpu().double() for v in (x, w13, w2, b13, weights))
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ x[t] + b13[e]
            gate = gu[:inter].clamp(max=LIMIT)
            up = gu[inter:].clamp(-LIMIT, LIMIT)
            y = w2[e] @ ((up + 1) * gate * torch.sigmoid(gate * ALPHA))
            if b2 is not None:
                y = y + b2[e].cpu().double()
            out[t] += weights[t, j] * y
    return out


# (tokens, hidden, intermediate, experts, top-k)
SHAPES = [
    (1, 32, 16, 4, 2),  # one token: most experts get nothing
    (9, 48, 40, 6, 2),  # widths off the 16-tile grid
    (21, 32, 24, 4, 3),  # several row blocks per expert
]


@pytest.mark.parametrize("down_bias", [True, False])
@pytest.mark.parametrize(("t", "h", "inter", "e", "k"), SHAPES)
def test_biases_and_swigluoai_match_the_reference(
    t: int, h: int, inter: int, e: int, k: int, down_bias: bool
) -> None:
    """Triton (small tiles) equals the torch reference, the public dispatch (Triton, default
    tiles) does too, and the reference equals the float64 oracle; the clamp bites (some
    gate/up values lie past the limit)."""
    x, w13, w2, b13, b2, weights, ids = _operands(t, h, inter, e, k, seed=t + e)
    biases = (b13, b2 if down_bias else None)
    kw = dict(biases=biases, swiglu=(ALPHA, LIMIT))
    got = fused_moe_triton(x, w13, w2, weights, ids, "swigluoai", tiles=SMALL_TILES, **kw)
    ref = fused_moe_ref(x, w13, w2, weights, ids, "swigluoai", **kw)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    dispatched = fused_moe(x, w13, w2, weights, ids, "swigluoai", **kw)
    torch.testing.assert_close(dispatched, ref, atol=2e-5, rtol=1e-5)
    oracle = _oracle(x, w13, w2, b13, biases[1], weights, ids)
    torch.testing.assert_close(ref.cpu().double(), oracle, atol=1e-5, rtol=1e-5)
    gate_up = torch.einsum("th,eih->tei", x, w13) + b13
    assert (gate_up.abs() > LIMIT).any()


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_each_part_matters(activation: str) -> None:
    """Biases with a plain SiLU, and swigluoai without biases, each equal the reference and
    differ from the run without that part (so neither is silently dropped)."""
    x, w13, w2, b13, b2, weights, ids = _operands(12, 32, 24, 4, 2, seed=7)
    swiglu = (ALPHA, LIMIT) if activation == "swigluoai" else None
    biases = (b13, b2) if activation == "silu" else None
    got = fused_moe_triton(
        x, w13, w2, weights, ids, activation, tiles=SMALL_TILES, biases=biases, swiglu=swiglu
    )
    ref = fused_moe_ref(x, w13, w2, weights, ids, activation, biases, swiglu)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    without = fused_moe_triton(x, w13, w2, weights, ids, tiles=SMALL_TILES)
    assert (without - got).abs().max() > 1e-2


def test_bad_biases_and_missing_swiglu_are_refused() -> None:
    x, w13, w2, b13, b2, weights, ids = _operands(3, 32, 16, 4, 2, seed=2)
    with pytest.raises(ValueError, match="biases must be"):
        fused_moe_triton(x, w13, w2, weights, ids, biases=(b13[:, :16], b2))
    with pytest.raises(ValueError, match="biases must be"):
        fused_moe_triton(x, w13, w2, weights, ids, biases=(b13, b2[:, :8]))
    with pytest.raises(ValueError, match="needs swiglu"):
        fused_moe(x, w13, w2, weights, ids, "swigluoai")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 1024])
def test_gpu_bf16_gpt_oss_20b_shapes(t: int) -> None:
    """gpt-oss-20b's experts (H = I = 2880, top-4 of 32, limit 7) in bf16 with default
    tiles, against the float32 reference on the same (bf16-rounded) operands."""
    x, w13, w2, b13, b2, weights, ids = _operands(t, 2880, 2880, 32, 4, seed=t)
    bf16 = [v.to(torch.bfloat16) for v in (x, w13, w2, b13, b2)]
    kw = dict(swiglu=(ALPHA, 7.0))
    got = fused_moe_triton(*bf16[:3], weights, ids, "swigluoai", biases=(bf16[3], bf16[4]), **kw)
    f32 = [v.float() for v in bf16]
    ref = fused_moe_ref(*f32[:3], weights, ids, "swigluoai", (f32[3], f32[4]), **kw)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 2e-2
