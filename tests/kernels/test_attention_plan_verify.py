"""Issue #43: speculative-decoding verify rows (a few query tokens each) are planned in one
numpy pass instead of one ``_plan_prefill`` call per sequence, with the same plans.

Checked: one-token rows go to the length groups, every row of 2..MAX_GROUPED_QUERY_TOKENS
tokens gets exactly the plan ``_plan_prefill`` gives it, longer prefills keep theirs, under
full, sliding-window and chunked attention; the outputs match the dense oracle; and a verify
row's bits are the same alone, in a mixed batch, and as the tail of a long prefill of its
sequence, so greedy tokens and logprobs do not move.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from kernel_inputs import Seq, build_metadata, new_cache, scatter_blocks

from tokenwire.kernels.attention_metadata import AttentionMetadata, PrefillSeqPlan
from tokenwire.kernels.attention_plan import (
    MAX_GROUPED_QUERY_TOKENS,
    _plan_prefill,
    build_cpu_plan,
    plan_for_window,
)
from tokenwire.kernels.paged_attention import paged_attention, paged_attention_dense_ref

BLOCK = 16
# Decodes first (the runner's layout), then verify rows (2..5 tokens) with long prefills
# between them: grouping must follow each row's query length, not its place in the step.
VERIFY_STEP = [
    (1, 37), (1, 200), (1, 5),
    (4, 40), (70, 70), (2, 19), (5, 130), (30, 95), (3, 64), (4, 300), (8, 8), (9, 41),
    (1, 33),  # a one-token row past the decodes (a prefill remainder)
]  # fmt: skip
# (window, chunk) of the attention: full, sliding window, chunked local attention.
SPANS = [(None, None), (24, None), (None, 32)]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread: at two, torch's CPU flash attention is not batch-invariant
    (``test_defects_invariant_attention``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _step(
    shape: Sequence[tuple[int, int]], seed: int = 0
) -> tuple[list[Seq], AttentionMetadata, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    seqs, num_blocks = scatter_blocks(shape, BLOCK, gen)
    k_cache, v_cache = new_cache(num_blocks, BLOCK, 3, 32, gen)
    return seqs, build_metadata(seqs, BLOCK), k_cache, v_cache


def _attend(
    meta: AttentionMetadata,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: tuple[int | None, int | None],
) -> torch.Tensor:
    """The torch path reads every key from the cache, so ``query`` stands in for K/V too."""
    key = value = query[:, :3]
    return paged_attention(
        query, key, value, k_cache, v_cache, meta, 32**-0.5,
        sliding_window=span[0], attention_chunk=span[1],
    )  # fmt: skip


def _same_plan(a: PrefillSeqPlan, b: PrefillSeqPlan) -> bool:
    head = (a.query_start, a.query_end, a.seq_len, a.key_start, len(a.groups))
    if head != (b.query_start, b.query_end, b.seq_len, b.key_start, len(b.groups)):
        return False
    if not torch.equal(a.block_ids, b.block_ids):
        return False
    return all(
        (g.row_start, g.row_end, g.key_offset, g.kv_len) == (h.row_start, h.row_end, h.key_offset,
                                                             h.kv_len)
        and torch.equal(g.mask, h.mask)
        for g, h in zip(a.groups, b.groups, strict=True)
    )  # fmt: skip


@pytest.mark.parametrize("span", SPANS)
def test_verify_rows_get_the_per_sequence_plans_in_one_pass(
    span: tuple[int | None, int | None],
) -> None:
    seqs, meta, _, _ = _step(VERIFY_STEP)
    windows, chunks = tuple(s for s in span[:1] if s), tuple(s for s in span[1:] if s)
    full = build_cpu_plan(
        meta.query_start_loc_np, meta.seq_lens_np, meta.block_tables, meta.num_decodes, BLOCK,
        windows, chunks,
    )  # fmt: skip
    plan = plan_for_window(full, *span)
    assert plan is not None
    qsl, lens = meta.query_start_loc_np, meta.seq_lens_np
    single = [i for i, (q, _, _) in enumerate(seqs) if q == 1]
    assert single == [0, 1, 2, 12]
    rows = torch.cat([g.rows for g in plan.decode_groups]).sort().values
    assert rows.tolist() == [int(qsl[i]) for i in single]
    short = [i for i, (q, _, _) in enumerate(seqs) if 1 < q <= MAX_GROUPED_QUERY_TOKENS]
    long = [i for i, (q, _, _) in enumerate(seqs) if q > MAX_GROUPED_QUERY_TOKENS]
    assert long == [4, 7, 11]
    tables = meta.block_tables.long()
    for i, got in zip(short + long, plan.prefills, strict=True):
        expect = _plan_prefill(
            int(qsl[i]), int(qsl[i + 1]), int(lens[i]), tables[i], BLOCK, *span
        )  # fmt: skip
        assert _same_plan(got, expect), f"sequence {i}"


@pytest.mark.parametrize("span", SPANS)
@pytest.mark.parametrize("seed", range(3))
def test_verify_step_matches_dense_reference(
    span: tuple[int | None, int | None], seed: int
) -> None:
    _, meta, k_cache, v_cache = _step(VERIFY_STEP, seed)
    query = torch.randn(meta.num_tokens, 9, 32, generator=torch.Generator().manual_seed(seed))
    fast = _attend(meta, query, k_cache, v_cache, span)
    dense = paged_attention_dense_ref(
        query, k_cache, v_cache, meta, 32**-0.5, sliding_window=span[0], attention_chunk=span[1]
    )
    torch.testing.assert_close(fast, dense, atol=1e-5, rtol=0)


def _rows_of(meta: AttentionMetadata, i: int) -> slice:
    return slice(int(meta.query_start_loc_np[i]), int(meta.query_start_loc_np[i + 1]))


@pytest.mark.parametrize("span", SPANS)
@pytest.mark.usefixtures("one_thread")
def test_verify_row_bits_alone_in_a_batch_and_as_a_prefill_tail(
    span: tuple[int | None, int | None],
) -> None:
    """Every short row of the step: its output alone (its sequence the only one), in the
    step, and as the last rows of a whole-sequence prefill (the per-row prefill path, which
    verify rows took before) are bit-identical."""
    seqs, meta, k_cache, v_cache = _step(VERIFY_STEP, seed=5)
    gen = torch.Generator().manual_seed(6)
    query = torch.randn(meta.num_tokens, 9, 32, generator=gen)
    batched = _attend(meta, query, k_cache, v_cache, span)
    for i, (query_len, seq_len, ids) in enumerate(seqs):
        if query_len > MAX_GROUPED_QUERY_TOKENS:
            continue
        rows = _rows_of(meta, i)
        alone = _attend(build_metadata([seqs[i]], BLOCK), query[rows], k_cache, v_cache, span)
        assert torch.equal(alone, batched[rows]), f"sequence {i} alone"
        if seq_len <= MAX_GROUPED_QUERY_TOKENS:
            continue  # no long prefill of this sequence to compare with
        prefill_meta = build_metadata([(seq_len, seq_len, ids)], BLOCK)
        assert prefill_meta.cpu_plan is not None and prefill_meta.cpu_plan.prefills
        head = torch.randn(seq_len - query_len, 9, 32, generator=gen)
        tail = _attend(prefill_meta, torch.cat([head, query[rows]]), k_cache, v_cache, span)
        assert torch.equal(tail[-query_len:], batched[rows]), f"sequence {i} as a prefill"
