"""``kernels.bf16_logits``: the CPU LM head on a bf16 copy of the weight, top logits in float32.

A row's logits are bit-identical whatever the number of rows and wherever the row sits (batch
invariance, defects #20), at 1 and 2 threads; each row's refined top logits are float32 dot
products (within float32 rounding of a float64 reference) and the argmax is the float32
head's; a non-float32 weight is plain ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tokenwire.kernels.bf16_logits import bf16_logits, bf16_supported, prepare_bf16_logits
from tokenwire.kernels.invariant_linear import invariant_linear, prepare_invariant_linear

N, K = 4096, 576
pytestmark = pytest.mark.skipif(
    not bf16_supported(torch.zeros(1, 1)), reason="oneDNN bf16 not available on this CPU"
)


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(N, K, generator=gen) * 0.05


@pytest.fixture(scope="module")
def rows() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(300, K, generator=gen)


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_a_rows_logits_do_not_depend_on_the_other_rows(
    weight: torch.Tensor, rows: torch.Tensor, threads: int
) -> None:
    w = prepare_bf16_logits(weight)
    assert w.packed is not None and w.refine == 16
    full = bf16_logits(rows, w)
    for m in (*range(1, 18), 31, 64, 255, 256, 257, 300):
        for start in (0, rows.shape[0] - m):
            got = bf16_logits(rows[start : start + m], w)
            assert torch.equal(got, full[start : start + m]), (threads, m, start)


def test_top_logits_are_float32_and_the_argmax_is_the_float32_heads(
    weight: torch.Tensor, rows: torch.Tensor
) -> None:
    w = prepare_bf16_logits(weight)
    got = bf16_logits(rows, w)
    assert got.dtype == torch.float32 and got.shape == (rows.shape[0], N)
    exact = rows.double() @ weight.double().t()
    top = exact.topk(4, dim=-1).indices
    torch.testing.assert_close(got.gather(1, top).double(), exact.gather(1, top), rtol=0, atol=1e-4)
    head32 = invariant_linear(rows, prepare_invariant_linear(weight))
    assert torch.equal(got.argmax(-1), head32.argmax(-1))
    # Elsewhere bf16: close, not exact.
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=0.05 * float(exact.abs().max()))


def test_a_bf16_weight_is_plain_f_linear(weight: torch.Tensor, rows: torch.Tensor) -> None:
    w16 = weight.to(torch.bfloat16)
    plain = prepare_bf16_logits(w16)
    assert plain.packed is None
    x = rows[:3].to(torch.bfloat16)
    assert torch.equal(bf16_logits(x, plain), torch.nn.functional.linear(x, w16))
    assert bf16_logits(rows[:0], prepare_bf16_logits(weight)).shape == (0, N)
