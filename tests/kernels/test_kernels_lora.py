"""Batched multi-LoRA matmul: run finding, the segment buffers, the torch reference against a
per-token loop, and the Triton shrink/expand kernels against the reference.

Tolerances: float32 paths must agree with a float64 per-token loop to rounding (rtol 1e-5,
atol 1e-5 of the largest delta); bf16/fp16 paths (operands, the shrink result and the output
rounded to 16 bits) within 1e-2 of the output's largest magnitude.

Triton kernels run under the CPU interpreter (small tiles, tiny shapes) in float32 and fp16:
Triton 3.6's interpreter computes bf16 dots wrongly (see ``test_kernels_quant_matmul``), so
bf16 runs only in the compiled ``gpu`` tests. ``test_triton_lora_kernels_compile_for_sm90``
checks that both kernels lower to a Hopper cubin without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenwire.kernels.lora import (
    LoRASegments,
    SegmentBuffers,
    add_lora,
    add_lora_torch,
    find_runs,
)
from tokenwire.kernels.lora_triton import LoRATiles, add_lora_triton

ON_CUDA = torch.cuda.is_available()


DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
CPU = torch.device("cpu")
f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
# Smallest tiles that compile (dot dims >= 16); N = 40, K = 48, R = 24 and T = 37 all leave a
# ragged last tile, and R = 24 takes two shrink column blocks and two expand R steps.
SMALL = LoRATiles(block_m=16, block_n=16, block_k=32, block_r_shrink=16, block_r=16)
# Runs of 10, 15, 5 and 4 tokens (two of slot 0), a -1 gap, and a -1 tail: T = 37.
MIXED = [0] * 10 + [-1] * 3 + [2] * 15 + [1] * 5 + [0] * 4


def adapters(
    ranks: list[int], k: int, n: int, dtype: torch.dtype = f32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked ``lora_a [S, R, K]``, ``lora_b [S, N, R]`` of the given ranks, zero-padded to
    ``R = max(ranks)`` (the layout the adapter manager writes)."""
    gen = torch.Generator().manual_seed(seed)
    r = max(ranks)
    lora_a = torch.zeros(len(ranks), r, k)
    lora_b = torch.zeros(len(ranks), n, r)
    for s, rank in enumerate(ranks):
        lora_a[s, :rank] = torch.randn(rank, k, generator=gen) / k**0.5
        lora_b[s, :, :rank] = torch.randn(n, rank, generator=gen)
    return lora_a.to(dtype), lora_b.to(dtype)


def per_token_ref(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    """The definition, one token at a time, in float64."""
    out = y.double().clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            out[t] += (x[t].double() @ lora_a[slot].double().T) @ lora_b[slot].double().T
    return out


def assert_matches(
    out: torch.Tensor, ref: torch.Tensor, y0: torch.Tensor, dtype: torch.dtype
) -> None:
    if dtype == f32:
        scale = (ref - y0.double()).abs().max().item()
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * scale)
    else:
        scale = ref.abs().max().item()
        err = (out.double() - ref).abs().max().item()
        assert err <= 1e-2 * scale, (err, scale)


def segments_for(slots: list[int], device: torch.device, max_segments: int = 8) -> LoRASegments:
    return SegmentBuffers(max_segments, device).fill(np.array(slots, dtype=np.int64))


def operands(
    t: int, k: int, n: int, dtype: torch.dtype, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, n, generator=gen).to(dtype), torch.randn(t, k, generator=gen).to(dtype)


# --- runs and segment buffers --------------------------------------------------------------


@pytest.mark.parametrize(
    ("slots", "runs"),
    [
        ([], []),
        ([-1, -1, -1], []),
        ([3], [(0, 1, 3)]),
        ([2, 2, 2, 2], [(0, 4, 2)]),
        ([0, 1, 0, 1], [(0, 1, 0), (1, 1, 1), (2, 1, 0), (3, 1, 1)]),
        ([-1, 5, 5, -1, -1, 0, 0, 0, 5], [(1, 2, 5), (5, 3, 0), (8, 1, 5)]),
    ],
    ids=["empty", "all_none", "single", "one_run", "interleaved", "gaps_and_repeat"],
)
def test_find_runs(slots: list[int], runs: list[tuple[int, int, int]]) -> None:
    found = find_runs(np.array(slots, dtype=np.int32))
    assert found == runs
    assert all(type(v) is int for run in found for v in run)


def test_segment_buffers_fill_rewrites_in_place() -> None:
    buffers = SegmentBuffers(4, CPU)
    first = buffers.fill(np.array([1, 1, -1, 0, 2, 2, 2]))
    assert first.runs == ((0, 2, 1), (3, 1, 0), (4, 3, 2)) and first.num_tokens == 7
    assert first.starts.tolist() == [0, 3, 4, 0] and first.lengths.tolist() == [2, 1, 3, 0]
    assert first.slots.tolist() == [1, 0, 2, 0] and first.lengths.dtype == torch.int32
    pointers = [t.data_ptr() for t in (first.starts, first.lengths, first.slots)]
    second = buffers.fill(np.array([-1, 3, 3]))  # fewer runs: stale entries become unused
    assert [t.data_ptr() for t in (second.starts, second.lengths, second.slots)] == pointers
    assert first.lengths.tolist() == [2, 0, 0, 0] and first.starts.tolist() == [1, 0, 0, 0]
    assert second.runs == ((1, 2, 3),) and second.num_tokens == 3


def test_segment_buffers_overflow_and_bad_size() -> None:
    buffers = SegmentBuffers(2, CPU)
    buffers.fill(np.array([0, 1, 1]))
    with pytest.raises(ValueError, match=r"3 LoRA runs.*max_segments=2"):
        buffers.fill(np.array([0, 1, 0]))
    with pytest.raises(ValueError, match="max_segments"):
        SegmentBuffers(0, CPU)


# --- torch reference ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_torch_reference_matches_per_token_loop(dtype: torch.dtype) -> None:
    """Mixed slots with -1 tokens, ranks 2/8/5 zero-padded to 8, slot 0 in two runs."""
    k, n = 24, 20
    lora_a, lora_b = adapters([2, 8, 5], k, n, dtype)
    y, x = operands(len(MIXED), k, n, dtype)
    y0 = y.clone()
    add_lora_torch(y, x, lora_a, lora_b, segments_for(MIXED, CPU))
    assert_matches(y, per_token_ref(y0, x, lora_a, lora_b, MIXED), y0, dtype)
    untouched = [t for t, slot in enumerate(MIXED) if slot < 0]
    assert torch.equal(y[untouched], y0[untouched])


def test_zero_padding_does_not_change_the_result() -> None:
    """A rank-3 adapter padded to R = 8 gives what the unpadded rank-3 matmuls give."""
    k, n = 16, 12
    lora_a, lora_b = adapters([3, 8], k, n)
    y, x = operands(6, k, n, f32)
    slots = [0, 0, 0, -1, 1, 1]
    out = y.clone()
    add_lora_torch(out, x, lora_a, lora_b, segments_for(slots, CPU))
    expected = y.clone()
    expected[:3] += (x[:3] @ lora_a[0, :3].T) @ lora_b[0, :, :3].T
    expected[4:] += (x[4:] @ lora_a[1].T) @ lora_b[1].T
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_shape_and_backend_errors() -> None:
    lora_a, lora_b = adapters([4], 8, 6)
    y, x = operands(3, 8, 6, f32)
    seg = segments_for([0, 0, 0], CPU)
    with pytest.raises(ValueError, match="shapes do not match"):
        add_lora_torch(y[:, :5], x, lora_a, lora_b, seg)
    with pytest.raises(ValueError, match="one dtype"):
        add_lora_torch(y, x.double(), lora_a, lora_b, seg)
    with pytest.raises(ValueError, match="unknown backend"):
        add_lora(y, x, lora_a, lora_b, seg, backend="cuda")


# --- Triton (interpreter on CPU, compiled on CUDA) -----------------------------------------


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter switch for one Triton test (``add_lora`` dispatches to Triton on CPU
    only while it is set); the reference tests above run without it."""
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def run_triton(
    slots: list[int], ranks: list[int], k: int, n: int, dtype: torch.dtype, tiles: LoRATiles
) -> None:
    lora_a, lora_b = adapters(ranks, k, n, dtype)
    y, x = operands(len(slots), k, n, dtype)
    y0 = y.clone()
    out = y.to(DEVICE)
    add_lora_triton(out, x.to(DEVICE), lora_a.to(DEVICE), lora_b.to(DEVICE),
                    segments_for(slots, DEVICE), tiles=tiles)  # fmt: skip
    assert out.dtype == dtype
    assert_matches(out.cpu(), per_token_ref(y0, x, lora_a, lora_b, slots), y0, dtype)
    untouched = [t for t, slot in enumerate(slots) if slot < 0]
    assert torch.equal(out.cpu()[untouched], y0[untouched])


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("dtype", [f32, f16])
def test_triton_matches_reference_ragged_tiles(dtype: torch.dtype) -> None:
    """T = 37, N = 40, K = 48, R = 24: every dimension ends in a partial tile; the 15-token
    run spans two row blocks; ranks 24/8/17 zero-padded; 8 segment entries, 4 used."""
    run_triton(MIXED, [24, 8, 17], 48, 40, dtype, SMALL)


@pytest.mark.usefixtures("interpret")
def test_triton_decode_runs_of_one_token() -> None:
    """Interleaved single-token runs (a decode batch in arrival order) fill the table."""
    run_triton([1, 0, -1, 1, 2, 0, 2, 1], [8, 8, 8], 32, 16, f32, SMALL)


@pytest.mark.usefixtures("interpret")
def test_triton_row_strided_views_and_default_tiles() -> None:
    """``x`` and ``y`` are column slices of wider buffers (row stride != width); the columns
    outside ``y``'s view stay untouched. Default tiles, through the ``add_lora`` dispatch."""
    k, n = 40, 24
    lora_a, lora_b = adapters([16, 4], k, n)
    wide_y, wide_x = operands(len(MIXED), k + 9, n + 7, f32, seed=5)
    slots = [min(s, 1) for s in MIXED]
    y, x = wide_y[:, 3 : 3 + n], wide_x[:, 5 : 5 + k]
    y0 = y.clone()
    ref = per_token_ref(y0, x, lora_a, lora_b, slots)
    wide = wide_y.to(DEVICE)
    view = wide[:, 3 : 3 + n]
    assert view.stride(0) != view.shape[1]
    add_lora(view, wide_x.to(DEVICE)[:, 5 : 5 + k], lora_a.to(DEVICE), lora_b.to(DEVICE),
             segments_for(slots, DEVICE))  # fmt: skip
    assert_matches(view.cpu(), ref, y0, f32)
    assert torch.equal(wide.cpu()[:, :3], wide_y[:, :3])
    assert torch.equal(wide.cpu()[:, 3 + n :], wide_y[:, 3 + n :])


@pytest.mark.usefixtures("interpret")
def test_triton_step_without_runs_leaves_y_unchanged() -> None:
    """All tokens without an adapter: the kernels still launch (graph capture) and write
    nothing; a leftover segment table from an earlier step must not leak in."""
    buffers = SegmentBuffers(4, DEVICE)
    buffers.fill(np.array([0, 0, 1, 1]))
    segments = buffers.fill(np.array([-1, -1, -1, -1]))
    lora_a, lora_b = adapters([8, 8], 16, 16)
    y, x = operands(4, 16, 16, f32)
    out = y.to(DEVICE)
    add_lora_triton(out, x.to(DEVICE), lora_a.to(DEVICE), lora_b.to(DEVICE), segments, tiles=SMALL)
    assert torch.equal(out.cpu(), y)


_COMPILE_CHECK = """
import importlib.util, sys, numpy as np, torch
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction
spec = importlib.util.spec_from_file_location("check", sys.argv[1])
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
check._PTR_TYPES.update({torch.float16: "fp16"})
launches = []
JITFunction.__getitem__ = lambda self, grid: lambda *a, **k: launches.append((self, a, k))
from tokenwire.kernels.lora import SegmentBuffers
from tokenwire.kernels.lora_triton import add_lora_triton
k, n, s = 4096, 4096, 4
for t, r, dtype in ((1, 16, torch.bfloat16), (64, 64, torch.bfloat16), (512, 128, torch.bfloat16),
                    (512, 256, torch.float16), (3, 8, torch.float32)):
    seg = SegmentBuffers(8, torch.device("cpu")).fill(np.zeros(t, dtype=np.int32))
    y, x = torch.empty(t, n, dtype=dtype), torch.empty(t, k, dtype=dtype)
    a, b = torch.empty(s, r, k, dtype=dtype), torch.empty(s, n, r, dtype=dtype)
    add_lora_triton(y, x, a, b, seg)
assert len(launches) == 10, len(launches)  # a shrink and an expand per call
for launch in launches:
    check.compile_launch(launch, GPUTarget("cuda", 90, 32))
"""


def test_triton_lora_kernels_compile_for_sm90() -> None:
    """bf16 decode/prefill tiles, ranks 16 to 256 (one and two shrink column blocks), fp16 and
    float32 IEEE dots: each launch lowers to a cubin for sm_90 (``triton_compile_check.py``)."""
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


# --- GPU: compiled, bf16, model shapes, CUDA graphs ----------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("t", "rank"), [(1, 16), (8, 64), (300, 16), (300, 128)])
def test_gpu_bf16_model_shapes(t: int, rank: int) -> None:
    k, n = 4096, 4096
    gen = np.random.default_rng(t)
    slots = np.sort(gen.integers(-1, 4, size=t)).tolist()  # runs in adapter order
    lora_a, lora_b = adapters([rank, rank // 2, rank, 1], k, n, bf16)
    y, x = operands(t, k, n, bf16)
    out = y.to(DEVICE)
    add_lora(out, x.to(DEVICE), lora_a.to(DEVICE), lora_b.to(DEVICE), segments_for(slots, DEVICE))
    assert_matches(out.cpu(), per_token_ref(y, x, lora_a, lora_b, slots), y, bf16)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_gpu_cuda_graph_replays_new_runs() -> None:
    """Capture once; ``SegmentBuffers.fill`` then changes the runs (count, slots, lengths)
    and a replay computes the new step's result."""
    t, k, n = 16, 256, 512
    lora_a, lora_b = adapters([16, 8, 16], k, n, bf16)
    a_dev, b_dev = lora_a.to(DEVICE), lora_b.to(DEVICE)
    buffers = SegmentBuffers(8, DEVICE)
    y_dev, x_dev = (v.to(DEVICE) for v in operands(t, k, n, bf16))
    segments = buffers.fill(np.array([0] * t))
    add_lora(y_dev, x_dev, a_dev, b_dev, segments)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora(y_dev, x_dev, a_dev, b_dev, segments)
    for seed, slots in ((3, [2] * 5 + [-1] * 3 + [0] * 8), (4, [1, 0, -1, 2] * 4)):
        y, x = operands(t, k, n, bf16, seed=seed)
        y_dev.copy_(y.to(DEVICE))
        x_dev.copy_(x.to(DEVICE))
        buffers.fill(np.array(slots))
        graph.replay()
        assert_matches(y_dev.cpu(), per_token_ref(y, x, lora_a, lora_b, slots), y, bf16)
