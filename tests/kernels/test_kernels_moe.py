"""The fused-MoE Triton kernel against its torch reference (``kernels.moe``), and the
reference against a dense per-token oracle.

Without CUDA the kernel runs under Triton's CPU interpreter on small float32 shapes with
16-wide tiles, so row blocks, padding and several column / depth tiles are all exercised; the
kernel is defined interpreted by the root conftest (tests/support/interpreted_kernels.py).
Shapes cover top-1 and top-k > 1, experts that receive no token, an expert that receives every
token, widths that are not multiples of the tiles, one token, and no tokens.
"""

from __future__ import annotations

import pytest
import torch

from tokenwire.kernels.moe import fused_moe, fused_moe_ref, select_experts
from tokenwire.kernels.moe_triton import (
    MoETiles,
    align_block_size,
    fused_moe_triton,
)

ON_CUDA = torch.cuda.is_available()

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
SMALL_TILES = MoETiles(16, 16, 16)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _operands(
    t: int, h: int, inter: int, e: int, k: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, inter, generator=gen) * inter**-0.5
    logits = torch.randn(t, e, generator=gen) * 2
    return tuple(v.to(DEVICE, dtype) for v in (x, w13, w2, logits))


def _dense_oracle(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Token by token, slot by slot, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e].double() @ x[t].double()
            h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[t] += float(weights[t, j]) * (w2[e].double() @ h)
    return out


# (tokens, hidden, intermediate, experts, top-k)
SHAPES = [
    (1, 32, 16, 4, 1),  # one token: 3 of 4 experts get nothing
    (7, 48, 40, 8, 2),  # widths off the 16-tile grid; most experts empty
    (24, 32, 24, 4, 2),  # several row blocks per expert
    (19, 64, 32, 6, 3),
]


@pytest.mark.parametrize(("t", "h", "inter", "e", "k"), SHAPES)
def test_triton_matches_reference(t: int, h: int, inter: int, e: int, k: int) -> None:
    x, w13, w2, logits = _operands(t, h, inter, e, k, seed=t + e)
    weights, ids = select_experts(logits, k, renormalize=k > 1)
    if t > 1:  # expert 0 never chosen, so some expert always has zero tokens
        weights, ids = select_experts(logits.index_fill(1, torch.tensor([0]), -1e9), k, True)
    got = fused_moe_triton(x, w13, w2, weights, ids, tiles=SMALL_TILES)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_reference_matches_dense_oracle() -> None:
    x, w13, w2, logits = _operands(9, 32, 24, 5, 2, seed=1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    oracle = _dense_oracle(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    got = fused_moe_ref(x, w13, w2, weights, ids).cpu().double()
    torch.testing.assert_close(got, oracle, atol=1e-5, rtol=1e-5)


def test_all_tokens_on_one_expert_and_gelu() -> None:
    x, w13, w2, _ = _operands(21, 32, 16, 4, 1, seed=3)
    ids = torch.full((21, 1), 2, dtype=torch.int64, device=DEVICE)
    weights = torch.rand(21, 1, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    for act in ("silu", "gelu_pytorch_tanh"):
        got = fused_moe_triton(x, w13, w2, weights, ids, act, tiles=SMALL_TILES)
        ref = fused_moe_ref(x, w13, w2, weights, ids, act)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("t", "k"), [(1, 1), (19, 1), (24, 2)])
def test_input_scaled_experts(t: int, k: int) -> None:
    """Llama 4: sigmoid top-k routing, each chosen expert run on ``w * x`` and summed
    unweighted: Triton equals the reference, and the reference a float64 oracle."""
    x, w13, w2, logits = _operands(t, 48, 40, 6, k, seed=t)
    weights, ids = select_experts(logits, k, False, sigmoid_topk=True)
    torch.testing.assert_close(weights, torch.sigmoid(logits.topk(k).values))
    got = fused_moe_triton(x, w13, w2, weights, ids, tiles=SMALL_TILES, scale_input=True)
    ref = fused_moe_ref(x, w13, w2, weights, ids, scale_input=True)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    dispatched = fused_moe(x, w13, w2, weights, ids, scale_input=True)  # Triton, default tiles
    torch.testing.assert_close(dispatched, ref, atol=2e-5, rtol=1e-5)
    scaled = torch.zeros(x.shape, dtype=torch.float64)
    for j in range(k):  # the oracle per slot, on that slot's scaled input
        ones = torch.ones(t, 1)
        xs = x.cpu() * weights.cpu()[:, j : j + 1]
        scaled += _dense_oracle(xs, w13.cpu(), w2.cpu(), ones, ids.cpu()[:, j : j + 1])
    torch.testing.assert_close(ref.cpu().double(), scaled, atol=1e-5, rtol=1e-5)


def test_no_tokens_and_dispatch() -> None:
    x, w13, w2, logits = _operands(0, 32, 16, 4, 2, seed=4)
    weights, ids = select_experts(logits, 2, True)
    assert fused_moe_triton(x, w13, w2, weights, ids).shape == (0, 32)
    x, w13, w2, logits = _operands(5, 32, 16, 4, 2, seed=5)
    weights, ids = select_experts(logits, 2, True)
    # Under the interpreter the dispatcher takes the Triton path (default tiles here).
    torch.testing.assert_close(
        fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids),
        atol=2e-5, rtol=1e-5,
    )  # fmt: skip
    with pytest.raises(ValueError, match="unsupported MoE activation"):
        fused_moe(x, w13, w2, weights, ids, "relu")
    with pytest.raises(ValueError, match="shapes do not fit"):
        fused_moe(x, w13, w2[:, :, :8], weights, ids)


def test_align_block_size_pads_each_expert_to_whole_blocks() -> None:
    ids = torch.tensor([[1, 3], [1, 0], [3, 1]], device=DEVICE)  # expert 2 gets nothing
    sorted_ids, block_experts = align_block_size(ids, 4, 4)
    n = ids.numel()
    assert sorted_ids.shape[0] == 20  # 6 + 4 * (4 - 1) rounded up to whole blocks
    blocks = sorted_ids.view(-1, 4).tolist()
    experts = block_experts.tolist()
    assert experts == [0, 1, 3] + [-1] * (len(experts) - 3)
    assert blocks[0] == [3, n, n, n]  # expert 0: assignment 3 (token 1, slot 1)
    assert blocks[1] == [0, 2, 5, n]  # expert 1, in token order
    assert blocks[2] == [1, 4, n, n]  # expert 3
    assert all(v == n for row in blocks[3:] for v in row)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 2048])
def test_triton_bf16_mixtral_shapes(t: int) -> None:
    """Mixtral-8x7B's expert shapes (H 4096, I 14336, top-2 of 8) in bf16 with default tiles."""
    x, w13, w2, logits = _operands(t, 4096, 14336, 8, 2, seed=t, dtype=torch.bfloat16)
    weights, ids = select_experts(logits, 2, True)
    got = fused_moe_triton(x, w13, w2, weights, ids).float()
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 2e-2
