"""Torch reference kernels for the paged KV cache: store_kv and paged attention.

The batched attention path is checked against the per-sequence dense oracle and against plain
causal attention over a contiguous sequence. RMSNorm, rotary and silu_and_mul are checked
against HF in ``test_kernels_hf_parity.py``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernel_inputs import build_metadata, new_cache, scatter_blocks

from tokenwire.kernels.attention_plan import canonical_blocks
from tokenwire.kernels.paged_attention import (
    build_cpu_plan,
    paged_attention,
    paged_attention_dense_ref,
)
from tokenwire.kernels.store_kv import store_kv


def run_step(
    shape: Sequence[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 16,
    block_size: int = 16,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step: store this step's K/V, then (fast path, dense oracle) outputs."""
    gen = torch.Generator().manual_seed(seed)
    seqs, num_blocks = scatter_blocks(shape, block_size, gen)
    k_cache, v_cache = new_cache(num_blocks, block_size, num_kv_heads, head_dim, gen)
    meta = build_metadata(seqs, block_size)
    query = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(meta.num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(meta.num_tokens, num_kv_heads, head_dim, generator=gen)
    store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    scale = head_dim**-0.5
    fast = paged_attention(query, key, value, k_cache, v_cache, meta, scale)
    dense = paged_attention_dense_ref(query, k_cache, v_cache, meta, scale)
    return fast, dense


DECODES = [(1, 37), (1, 16), (1, 200), (1, 5), (1, 129), (1, 64)]
FRESH = [(20, 20)]
CACHED = [(13, 50), (1, 33), (16, 48)]  # prefix hits / later chunks; (1, 33) is a prefill row
CASES = {
    "decode": DECODES,
    "fresh_prefill": [(40, 40), (7, 7)],
    "cached_prefill": CACHED,
    "mixed": DECODES + FRESH + CACHED + [(3, 3)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2), (8, 2), (8, 1), (9, 3)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_matches_dense_reference(
    case: str, heads: tuple[int, int], block_size: int
) -> None:
    fast, dense = run_step(CASES[case], *heads, block_size=block_size)
    torch.testing.assert_close(fast, dense, atol=1e-5, rtol=0)


def test_paged_attention_smollm_shapes() -> None:
    """The default model's layout: 9 query heads over 3 KV heads, head_dim 64."""
    fast, dense = run_step(CASES["mixed"], 9, 3, head_dim=64, block_size=16, seed=1)
    torch.testing.assert_close(fast, dense, atol=1e-5, rtol=0)


def test_paged_attention_builds_plan_when_missing_and_zeroes_padding_rows() -> None:
    gen = torch.Generator().manual_seed(2)
    seqs, num_blocks = scatter_blocks(DECODES + CACHED, 16, gen)
    k_cache, v_cache = new_cache(num_blocks, 16, 2, 16, gen)
    with_plan = build_metadata(seqs, 16, num_padding_rows=3)
    without_plan = build_metadata(seqs, 16, num_padding_rows=3, with_plan=False)
    query = torch.randn(with_plan.num_tokens, 4, 16, generator=gen)
    key = torch.randn(with_plan.num_tokens, 2, 16, generator=gen)
    value = torch.randn(with_plan.num_tokens, 2, 16, generator=gen)
    store_kv(key, value, k_cache, v_cache, with_plan.slot_mapping)
    a = paged_attention(query, key, value, k_cache, v_cache, with_plan, 0.25)
    b = paged_attention(query, key, value, k_cache, v_cache, without_plan, 0.25)
    assert torch.equal(a, b)
    assert torch.count_nonzero(a[-3:]) == 0
    dense = paged_attention_dense_ref(query, k_cache, v_cache, with_plan, 0.25)
    torch.testing.assert_close(a, dense, atol=1e-5, rtol=0)


def test_decode_groups_cover_each_row_once_with_correct_masks() -> None:
    seq_lens = np.array([5, 380, 33, 200, 17, 381, 64, 90], dtype=np.int32)
    query_start_loc = np.arange(len(seq_lens) + 1, dtype=np.int32)
    max_blocks = math.ceil(int(seq_lens.max()) / 16)
    tables = torch.arange(1, 1 + len(seq_lens) * max_blocks, dtype=torch.int32)
    tables = tables.view(len(seq_lens), max_blocks)
    plan = build_cpu_plan(query_start_loc, seq_lens, tables, len(seq_lens), 16)
    assert plan.prefills == ()
    assert len(plan.decode_groups) > 1  # lengths 5..381 are too spread for one padded batch
    rows = torch.cat([g.rows for g in plan.decode_groups]).sort().values
    assert rows.tolist() == list(range(len(seq_lens)))
    for group in plan.decode_groups:
        lens = torch.from_numpy(seq_lens)[group.rows]
        # Every row of a group is padded to the same canonical length, a function of its own
        # length (batch invariance); past the table's end the index is clamped (masked keys).
        own = canonical_blocks(np.ceil(lens.numpy() / 16).astype(np.int64), 16)
        assert set(own.tolist()) == {group.max_blocks}
        assert group.max_blocks >= math.ceil(int(lens.max()) / 16)
        assert torch.equal(group.mask[:, 0, 0].sum(dim=1), lens.long())
        columns = torch.arange(group.max_blocks).clamp(max=tables.shape[1] - 1)
        expect_ids = tables[group.rows][:, columns].reshape(-1).long()
        assert torch.equal(group.block_ids, expect_ids)


def test_equal_lengths_make_one_decode_group() -> None:
    seq_lens = np.full(8, 100, dtype=np.int32)
    tables = torch.arange(1, 1 + 8 * 7, dtype=torch.int32).view(8, 7)
    plan = build_cpu_plan(np.arange(9, dtype=np.int32), seq_lens, tables, 8, 16)
    assert len(plan.decode_groups) == 1


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (9, 3)])
def test_chunked_paged_attention_equals_dense_causal_attention(heads: tuple[int, int]) -> None:
    """Prefill in two chunks, then decode: outputs equal one causal pass over the sequence."""
    num_heads, num_kv_heads = heads
    head_dim, block_size, total = 32, 16, 70
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(total, num_heads, head_dim, generator=gen)
    key = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    block_ids = [7, 2, 9, 4, 11]  # unsorted physical blocks for 5 * 16 >= 70 positions
    k_cache, v_cache = new_cache(12, block_size, num_kv_heads, head_dim, gen)
    bounds = [0, 30, 55, *range(56, total + 1)]  # chunks of 30 and 25, then 15 decodes
    outs = []
    for start, end in itertools.pairwise(bounds):
        ids = block_ids[: math.ceil(end / block_size)]
        meta = build_metadata([(end - start, end, ids)], block_size)
        rows = slice(start, end)
        store_kv(key[rows], value[rows], k_cache, v_cache, meta.slot_mapping)
        outs.append(
            paged_attention(
                query[rows], key[rows], value[rows], k_cache, v_cache, meta, head_dim**-0.5
            )
        )
    group = num_heads // num_kv_heads
    expect = F.scaled_dot_product_attention(
        query.double().transpose(0, 1),
        key.double().repeat_interleave(group, dim=1).transpose(0, 1),
        value.double().repeat_interleave(group, dim=1).transpose(0, 1),
        is_causal=True,
        scale=head_dim**-0.5,
    ).transpose(0, 1)
    torch.testing.assert_close(torch.cat(outs).double(), expect, atol=1e-5, rtol=0)


def test_store_kv_skips_padding_slots_and_ignores_extra_slot_entries() -> None:
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache = new_cache(4, 8, 2, 4, gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key = torch.randn(4, 2, 4, generator=gen)
    value = torch.randn(4, 2, 4, generator=gen)
    # Rows 1 and 3 are padding; the trailing 9 is beyond T and must not be used.
    slots = torch.tensor([8 + 3, -1, 3 * 8 + 7, -1, 9], dtype=torch.int64)
    store_kv(key, value, k_cache, v_cache, slots)
    expect_k, expect_v = k_before.clone(), v_before.clone()
    expect_k[1, 3], expect_v[1, 3] = key[0], value[0]
    expect_k[3, 7], expect_v[3, 7] = key[2], value[2]
    assert torch.equal(k_cache, expect_k)
    assert torch.equal(v_cache, expect_v)
    assert torch.count_nonzero(k_cache[0]) == 0  # the null block is never written


def test_store_kv_unpadded_writes_every_row_from_strided_views() -> None:
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = new_cache(3, 4, 2, 4, gen)
    kv = torch.randn(5, 2, 8, generator=gen)  # K and V as strided halves of one tensor
    key, value = kv[..., :4], kv[..., 4:]
    slots = torch.tensor([4, 5, 6, 11, 8], dtype=torch.int64)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 4)[slots], key)
    assert torch.equal(v_cache.view(-1, 2, 4)[slots], value)


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches_match_dense_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    shape = [(1, int(n)) for n in rng.integers(1, 300, size=int(rng.integers(0, 9)))]
    for _ in range(int(rng.integers(1, 4))):
        seq_len = int(rng.integers(1, 200))
        shape.append((int(rng.integers(1, seq_len + 1)), seq_len))
    heads = [(4, 4), (6, 2), (8, 1), (9, 3)][seed % 4]
    fast, dense = run_step(shape, *heads, block_size=[16, 32][seed % 2], seed=seed)
    torch.testing.assert_close(fast, dense, atol=1e-5, rtol=0)
