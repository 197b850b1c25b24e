"""``kernels.vnni_matmul``'s int8 "k" layout (``pack_int8k_vnni``: GGUF Q8_0 / Q6_K / Q5_K kept
quantized on CPU): int8 codes with float32 scales per 16 inputs (Q6_K) or per 32 spread to 16
(Q8_0, Q5_K), and optional float32 minimums per 32 (Q5_K's ``- dmin * m``).

The layout round-trips exactly (float32 scales that are no fp16 values included); outputs are
within the int4 / int8 paths' bound of the float64 product; a row's bits do not depend on the
row count, the other rows or the thread count.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tokenwire.kernels.vnni_matmul import dequantize_vnni, pack_int8k_vnni, vnni_matmul, vnni_status

pytestmark = pytest.mark.skipif(
    not vnni_status().loaded, reason=f"no VNNI kernel here: {vnni_status().reason}"
)
BOUND = 5e-4  # as tests/kernels/test_vnni_matmul.py


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _weights(
    n: int, k: int, group: int, with_mins: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Q6_K-like (codes -32..31, scales ``d * sc`` per 16: not fp16 values) or Q5_K-like
    (codes 0..31, scale and ``- dmin * m`` per 32) random weights."""
    g = torch.Generator().manual_seed(seed)
    low, high = (0, 32) if with_mins else (-32, 32)
    codes = torch.randint(low, high, (n, k), generator=g).to(torch.int8)
    d = torch.tensor(0.00037).half().float()
    scales = d * torch.randint(-128, 128, (n, k // group), generator=g).float()
    mins = -d * torch.randint(0, 64, (n, k // 32), generator=g).float() if with_mins else None
    return codes, scales, mins


def _dense(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    n, k = codes.shape
    group = k // scales.shape[1]
    w = (codes.double().view(n, -1, group) * scales.double()[..., None]).view(n, k)
    if mins is not None:
        w = (w.view(n, -1, 32) + mins.double()[..., None]).view(n, k)
    return w


def _activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * torch.rand(k, generator=g) * 4


@pytest.mark.parametrize(("group", "with_mins"), [(16, False), (32, False), (32, True)])
@pytest.mark.parametrize(("n", "k"), [(200, 576), (16, 32)])
def test_round_trip_exact_and_bound(n: int, k: int, group: int, with_mins: bool) -> None:
    codes, scales, mins = _weights(n, k, group, with_mins)
    w = pack_int8k_vnni(codes, scales, mins)
    dense = _dense(codes, scales, mins)
    assert w.mode == 16 and w.scales.dtype == torch.float32
    assert torch.equal(dequantize_vnni(w).double(), dense.float().double())
    x = _activations(7, k)
    out = vnni_matmul(x, w)
    assert out.shape == (7, n) and out.dtype == torch.float32
    ref = x.double() @ dense.t()
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < BOUND


@pytest.mark.parametrize("with_mins", [False, True])
def test_a_row_is_batch_and_thread_invariant(with_mins: bool, threads: None) -> None:
    codes, scales, mins = _weights(96, 576, 16 if not with_mins else 32, with_mins)
    w = pack_int8k_vnni(codes, scales, mins)
    x = _activations(37, 576)
    torch.set_num_threads(1)
    alone = [vnni_matmul(x[i : i + 1], w)[0] for i in (0, 5, 36)]
    torch.set_num_threads(2)
    for rows in (37, 16, 6):
        batch = vnni_matmul(x[:rows], w)
        for i, row in zip((0, 5, 36), alone, strict=True):
            if i < rows:
                assert torch.equal(batch[i], row), (rows, i)
