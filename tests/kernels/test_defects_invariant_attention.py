"""Defects #20: the torch paged-attention path gives a query row the same bits whatever else
the step holds.

One "target" sequence (SmolLM2's 9 query heads over 3 KV heads, head_dim 64) has fixed
queries, keys and values at every position. Its rows are computed in many step shapes: a
fresh prefill of the whole prompt, later chunks after a prefix hit (the scheduler's chunked
prefill and prefix caching), a one-token remainder (which the runner batches as a decode
row), a decode row alone and among other decode rows of other context lengths, next to other
prefills. Every shape must give each target row bit-identical output.

That holds with one torch thread. With two, PyTorch's CPU flash-attention kernel (behind sdpa)
is not batch-invariant: measured on torch 2.13, a row's bits change with the number of
(batch, head) work items in the call, though each row's inputs are the same; the case stays
here as an xfail (not strict: on a loaded box the split can happen to come out the same).
Engine-level greedy invariance at two threads is checked in
``tests/runtime/test_defects_invariant_engine.py``; see docs/quantization.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch
from kernel_inputs import build_metadata

from tokenwire.kernels.kv_quant import FP8_KV_DTYPE
from tokenwire.kernels.paged_attention import paged_attention
from tokenwire.kernels.store_kv import store_kv

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
TARGET_LEN = 70
SCALE = HEAD_DIM**-0.5


@dataclass(frozen=True)
class Target:
    query: torch.Tensor  # [TARGET_LEN, HEADS, HEAD_DIM]
    key: torch.Tensor  # [TARGET_LEN, KV_HEADS, HEAD_DIM]
    value: torch.Tensor


def make_target(seed: int = 0) -> Target:
    gen = torch.Generator().manual_seed(seed)
    shape = (TARGET_LEN, KV_HEADS, HEAD_DIM)
    q = torch.randn(TARGET_LEN, HEADS, HEAD_DIM, generator=gen)
    return Target(q, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))


def run_with_target(
    target: Target,
    target_rows: tuple[int, int],
    others: Sequence[tuple[int, int]],
    *,
    window: int | None = None,
    fp8: bool = False,
    seed: int = 1,
) -> torch.Tensor:
    """Attention output of the target's rows ``[first, end)`` computed in one step next to
    ``others`` ((query_len, seq_len) each, random contents); decode rows go first."""
    gen = torch.Generator().manual_seed(seed)
    first, end = target_rows
    shapes = [(end - first, end), *others]
    order = sorted(range(len(shapes)), key=lambda i: shapes[i][0] != 1)  # decodes first
    num_blocks = 1 + sum(math.ceil(s / BLOCK) for _, s in shapes)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    seqs = []
    for i in order:
        n = math.ceil(shapes[i][1] / BLOCK)
        seqs.append((shapes[i][0], shapes[i][1], free[:n]))
        free = free[n:]
    meta = build_metadata(seqs, BLOCK)
    cache_shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, generator=gen)
    v_cache = torch.randn(cache_shape, generator=gen)
    query = torch.randn(meta.num_tokens, HEADS, HEAD_DIM, generator=gen)
    key = torch.randn(meta.num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    value = torch.randn(meta.num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    slot = order.index(0)
    ids = seqs[slot][2]
    row0 = int(meta.query_start_loc_np[slot])
    rows = slice(row0, row0 + end - first)
    query[rows], key[rows], value[rows] = (
        target.query[first:end], target.key[first:end], target.value[first:end]
    )  # fmt: skip
    if fp8:
        k_cache, v_cache = k_cache.to(FP8_KV_DTYPE), v_cache.to(FP8_KV_DTYPE)
    k_scale = v_scale = torch.tensor([0.5]) if fp8 else None
    # The target's earlier positions are in the cache already (a prefix hit or earlier steps).
    past = torch.arange(first)
    past_slots = torch.tensor(ids, dtype=torch.int64)[past // BLOCK] * BLOCK + past % BLOCK
    past_k, past_v = target.key[:first], target.value[:first]
    store_kv(past_k, past_v, k_cache, v_cache, past_slots, k_scale, v_scale)
    store_kv(key, value, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    out = paged_attention(
        query, key, value, k_cache, v_cache, meta, SCALE, k_scale, v_scale, sliding_window=window
    )
    return out[rows]


OTHERS = {
    "alone": [],
    "decodes": [(1, 5), (1, 60), (1, 75), (1, 100), (1, 300), (1, 71)],
    "prefills": [(40, 40), (13, 50), (3, 3)],
    "mixed": [(1, 37), (1, 200), (20, 20), (16, 48), (1, 70)],
    # Speculative verify rows (issue #43: their plans built in one numpy pass).
    "verify": [(1, 37), (4, 40), (2, 90), (5, 120), (3, 64), (30, 30)],
}
# (first, end) of the target rows: a whole fresh prompt, later chunks, one-token remainders,
# verify rows of 4 and 2 tokens.
SPLITS = [(0, 70), (0, 40), (40, 70), (32, 70), (64, 70), (69, 70), (39, 40), (17, 33), (0, 1),
          (66, 70), (30, 32)]  # fmt: skip


@pytest.fixture(
    params=[
        1,
        pytest.param(
            2,
            marks=pytest.mark.xfail(
                strict=False,  # holds by chance on a loaded box (xdist workers share 2 cores)
                reason="torch's CPU flash attention: not batch-invariant at 2 threads",
            ),
        ),
    ]
)
def torch_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(("window", "fp8"), [(None, False), (24, False), (None, True)])
def test_target_rows_get_the_same_bits_in_every_step_shape(
    window: int | None, fp8: bool, torch_threads: int
) -> None:
    target = make_target()
    reference = run_with_target(target, (0, TARGET_LEN), [], window=window, fp8=fp8)
    for first, end in SPLITS:
        for name, others in OTHERS.items():
            got = run_with_target(target, (first, end), others, window=window, fp8=fp8, seed=7)
            for j, pos in enumerate(range(first, end)):
                assert torch.equal(got[j], reference[pos]), (
                    f"row {pos} computed as rows [{first}, {end}) with {name} differs"
                )
