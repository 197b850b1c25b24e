"""Per-step gather plans of the torch paged-attention path (``CpuAttentionPlan``).

``build_cpu_plan`` runs once per step and turns block tables into gather indices and masks
that every layer reuses. Models with sliding-window layers get one extra plan per distinct
window: a windowed row gathers only the blocks holding its last ``window`` positions (so its
cost no longer grows with the context) and its mask allows key ``k`` for the query at ``q``
when ``q - window < k <= q`` (HF's ``sliding_window_overlay``). Chunked local attention
(Llama 4) gets one plan per chunk size ``C``: the query at ``q`` sees keys
``q // C * C <= k <= q`` (HF's ``chunked_overlay``) and gathers only its chunk's blocks.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from tokenwire.kernels.attention_metadata import (
    CpuAttentionPlan,
    DecodeGroupPlan,
    PrefillRowGroup,
    PrefillSeqPlan,
)

# Every query row (decode or prefill) is attended as a single-token query over a key range
# whose length is a function of its own position only: the keys from its window's first block
# up to its own block, padded to the next length of a fixed ladder (32-token steps below 256,
# then steps of 12.5%). sdpa then runs the same computation for a row whatever else the step
# holds: how many rows share its batch, whether it is a decode row, a fresh prefill, a later
# chunk or a one-token remainder (defects #20; before, a prefill ran sdpa over the whole chunk,
# whose blocking of the queries and keys changed a row's rounding). Decode rows with the same
# padded length form one group: measured on 2 shared CPU cores, SmolLM2 shapes, 64 decodes
# with context U[32, 380], one padded group per batch is 2-3x slower than ~8 length groups
# (the gather of padded K/V dominates); between 6 and 21 groups the time is flat.
#
# Issue #43: with speculative decoding every running row is a verify row of a few query
# tokens, and 64 of them had cost 64 ``_plan_prefill`` calls a step (5-20 ms on 2 CPU cores).
# Sequences of 2..MAX_GROUPED_QUERY_TOKENS tokens now get the same per-sequence plans built in
# one numpy pass (``_plan_short_prefills``, ~1-2 ms at 64 rows); one-token rows, decode or
# not, join the length groups. The plans and so every row's arithmetic are unchanged. Putting
# each verify token into the length groups instead was tried: it copies a sequence's K/V once
# per token instead of sharing one gather, and one layer's attention then took 2-6x as long
# at SmolLM2's shapes (one thread); folding a sequence's tokens into sdpa's query length would
# share the gather but changes a row's bits (docs/benchmarks.md, "n-gram proposer cost").
# The cap (8: num_speculative_tokens <= 7) bounds the padded mask of the numpy pass, one row
# per token as wide as the widest range; a longer prefill keeps ``_plan_prefill``.
MAX_GROUPED_QUERY_TOKENS = 8
_LINEAR_STEP_TOKENS = 32
_GEOMETRIC_FROM_TOKENS = 256
_GEOMETRIC_NUM, _GEOMETRIC_DEN = 9, 8  # steps of 12.5%


def build_cpu_plan(
    query_start_loc_np: np.ndarray,
    seq_lens_np: np.ndarray,
    block_tables: torch.Tensor,
    num_decodes: int,
    block_size: int,
    windows: tuple[int, ...] = (),
    chunks: tuple[int, ...] = (),
) -> CpuAttentionPlan:
    """Precompute per-step gathers so each layer only indexes and calls sdpa.

    Rows ``[0, num_decodes)`` must have exactly one query token each; they and any other
    one-token row are attended in length groups, longer rows per sequence (those of at most
    ``MAX_GROUPED_QUERY_TOKENS`` tokens, verify rows, planned in one pass). ``windows``: the
    distinct sliding windows of the model's layers; each gets its own plan in ``windowed``.
    ``chunks``: the distinct attention chunk sizes (Llama 4); each gets a plan in ``chunked``.
    """
    tables = block_tables.to(torch.int64)  # once per step: index_select wants int64
    args = (query_start_loc_np, seq_lens_np, tables, num_decodes, block_size)
    full = _plan(*args, None)
    windowed = tuple((w, _plan(*args, w)) for w in sorted(set(windows)))
    chunked = tuple((c, _plan(*args, None, c)) for c in sorted(set(chunks)))
    return CpuAttentionPlan(full.decode_groups, full.prefills, windowed, chunked)


def plan_for_window(
    plan: CpuAttentionPlan, window: int | None, chunk: int | None = None
) -> CpuAttentionPlan | None:
    """The plan of layers with attention window ``window`` or chunk size ``chunk`` (both
    None: full attention); None when ``plan`` was built without it."""
    if window is not None and chunk is not None:
        raise ValueError("a layer has either a sliding window or an attention chunk size")
    if chunk is not None:
        return next((p for c, p in plan.chunked if c == chunk), None)
    if window is None:
        return plan
    for w, windowed in plan.windowed:
        if w == window:
            return windowed
    return None


def _plan(
    query_start_loc_np: np.ndarray,
    seq_lens_np: np.ndarray,
    tables: torch.Tensor,
    num_decodes: int,
    block_size: int,
    window: int | None,
    chunk: int | None = None,
) -> CpuAttentionPlan:
    query_start = np.asarray(query_start_loc_np, dtype=np.int64)
    seq_lens = np.asarray(seq_lens_np, dtype=np.int64)
    query_lens = np.diff(query_start)
    single = query_lens == 1
    single[:num_decodes] = True
    short = ~single & (query_lens <= MAX_GROUPED_QUERY_TOKENS)
    rows, seqs, positions = _short_query_rows(query_start, seq_lens, np.flatnonzero(single))
    decode_groups = _plan_decode_groups(
        rows, seqs, positions, tables, block_size, window, chunk
    )  # fmt: skip
    shared = _plan_short_prefills(
        query_start, seq_lens, np.flatnonzero(short), tables, block_size, window, chunk
    )  # fmt: skip
    prefills = tuple(
        _plan_prefill(
            int(query_start[i]),
            int(query_start[i + 1]),
            int(seq_lens[i]),
            tables[i],
            block_size,
            window,
            chunk,
        )
        for i in np.flatnonzero(~single & ~short).tolist()
    )
    return CpuAttentionPlan(decode_groups=decode_groups, prefills=shared + prefills)


def _short_query_rows(
    query_start: np.ndarray, seq_lens: np.ndarray, seqs: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(query row, sequence, position) of every query token of the sequences ``seqs``, in
    row order. Vectorized: no loop per sequence."""
    lens = query_start[seqs + 1] - query_start[seqs]
    # Each token's index within its sequence's query tokens.
    within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    rows = np.repeat(query_start[seqs], lens) + within
    positions = np.repeat(seq_lens[seqs] - lens, lens) + within
    return rows, np.repeat(seqs, lens), positions


def canonical_blocks(num_blocks: np.ndarray, block_size: int) -> np.ndarray:
    """The padded key length (in blocks) of rows whose keys span ``num_blocks`` blocks: the
    next ladder length of at least that many tokens, rounded up to whole blocks."""
    tokens = np.asarray(num_blocks, dtype=np.int64) * block_size
    linear = -(-tokens // _LINEAR_STEP_TOKENS) * _LINEAR_STEP_TOKENS
    top = int(tokens.max(initial=0))
    ladder = [_GEOMETRIC_FROM_TOKENS]
    while ladder[-1] < top:
        ladder.append(-(-ladder[-1] * _GEOMETRIC_NUM // _GEOMETRIC_DEN))
    geometric = np.asarray(ladder, dtype=np.int64)[np.searchsorted(ladder, tokens)]
    padded = np.where(tokens <= _GEOMETRIC_FROM_TOKENS, linear, geometric)
    return -(-padded // block_size)


def _key_ranges(
    positions: np.ndarray, block_size: int, window: int | None, chunk: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per query position: (first key it may see, first block gathered, padded blocks)."""
    first_key = np.zeros_like(positions)
    if window is not None:
        first_key = np.maximum(positions + 1 - window, 0)
    if chunk is not None:
        first_key = positions // chunk * chunk
    first_block = first_key // block_size
    num_blocks = positions // block_size + 1 - first_block
    return first_key, first_block, canonical_blocks(num_blocks, block_size)


def _mask(
    positions: np.ndarray, first_key: np.ndarray, key_start: np.ndarray, kv_len: int
) -> np.ndarray:
    """Bool [n, kv_len]: key ``key_start + j`` is in row ``i``'s window, at most its position.
    Compared in columns past ``key_start``: no [n, kv_len] array of key positions."""
    columns = np.arange(kv_len)[None, :]
    allowed: np.ndarray = (columns <= (positions - key_start)[:, None]) & (
        columns >= (first_key - key_start)[:, None]
    )
    return allowed


def _plan_decode_groups(
    rows: np.ndarray,
    seqs: np.ndarray,
    positions: np.ndarray,
    tables: torch.Tensor,
    block_size: int,
    window: int | None,
    chunk: int | None = None,
) -> tuple[DecodeGroupPlan, ...]:
    """Length groups of the query rows ``rows`` (of sequences ``seqs``, at ``positions``):
    each row gathers its own sequence's blocks over its own canonical key range."""
    if len(rows) == 0:
        return ()
    first_key, first_block, padded = _key_ranges(positions, block_size, window, chunk)
    order = np.argsort(-padded, kind="stable")  # longest first
    splits = np.flatnonzero(np.diff(padded[order])) + 1
    # Built in numpy and converted once per group: this runs every step on the host.
    tables_np = tables.numpy() if tables.device.type == "cpu" else tables.cpu().numpy()
    width = tables_np.shape[1]
    groups: list[DecodeGroupPlan] = []
    for members in np.split(order, splits):
        max_blocks = int(padded[members[0]])
        block_index = first_block[members][:, None] + np.arange(max_blocks)[None, :]
        # Past a row's last block the index may run off the table: those keys are masked.
        block_index = np.minimum(block_index, width - 1)
        block_ids = np.take_along_axis(tables_np[seqs[members]], block_index, axis=1)
        mask = _mask(
            positions[members], first_key[members], first_block[members] * block_size,
            max_blocks * block_size,
        )  # fmt: skip
        groups.append(
            DecodeGroupPlan(
                rows=torch.from_numpy(np.ascontiguousarray(rows[members])).to(tables.device),
                block_ids=torch.from_numpy(block_ids.reshape(-1)).to(tables.device),
                max_blocks=max_blocks,
                mask=torch.from_numpy(mask[:, None, None, :]).to(tables.device),
            )
        )
    return tuple(groups)


def _plan_short_prefills(
    query_start: np.ndarray,
    seq_lens: np.ndarray,
    seqs: np.ndarray,
    tables: torch.Tensor,
    block_size: int,
    window: int | None,
    chunk: int | None = None,
) -> tuple[PrefillSeqPlan, ...]:
    """``_plan_prefill`` of each of ``seqs`` (short multi-token rows), the same plans, with
    the key ranges, block ids and masks of all of them computed in one numpy pass; Python
    only wraps each sequence's and run's slices (each run's mask cut from one padded array)."""
    rows, seq_of, positions = _short_query_rows(query_start, seq_lens, seqs)
    if len(rows) == 0:
        return ()
    first_key, first_block, padded = _key_ranges(positions, block_size, window, chunk)
    seq_lo = np.flatnonzero(np.r_[True, seq_of[1:] != seq_of[:-1]])
    run_starts = np.zeros(len(rows), dtype=bool)
    run_starts[seq_lo] = True
    run_starts[1:] |= (np.diff(first_block) != 0) | (np.diff(padded) != 0)
    run_lo = np.flatnonzero(run_starts)
    run_hi = np.r_[run_lo[1:], len(rows)]
    # A sequence's first row has its smallest first block (positions increase).
    start_block = first_block[seq_lo]
    num_blocks = np.maximum.reduceat(first_block + padded, seq_lo) - start_block
    within = np.arange(int(num_blocks.sum())) - np.repeat(np.cumsum(num_blocks) - num_blocks,
                                                          num_blocks)  # fmt: skip
    tables_np = tables.numpy() if tables.device.type == "cpu" else tables.cpu().numpy()
    columns = np.minimum(np.repeat(start_block, num_blocks) + within, tables_np.shape[1] - 1)
    block_ids = tables_np[np.repeat(seq_of[seq_lo], num_blocks), columns]
    ids = torch.from_numpy(block_ids).to(tables.device).split(num_blocks.tolist())
    kv_lens = padded * block_size
    mask = _mask(positions, first_key, first_block * block_size, int(kv_lens.max()))
    run_seq = np.searchsorted(seq_lo, run_lo, side="right") - 1
    groups: list[list[PrefillRowGroup]] = [[] for _ in seq_lo]
    for lo, hi, s in zip(run_lo.tolist(), run_hi.tolist(), run_seq.tolist(), strict=True):
        kv_len = int(kv_lens[lo])
        run_mask = np.ascontiguousarray(mask[lo:hi, None, None, :kv_len])
        groups[s].append(
            PrefillRowGroup(
                row_start=int(rows[lo]),
                row_end=int(rows[lo]) + hi - lo,
                key_offset=int(first_block[lo] - start_block[s]) * block_size,
                kv_len=kv_len,
                mask=torch.from_numpy(run_mask).to(tables.device),
            )
        )
    seq_hi = np.r_[seq_lo[1:], len(rows)]
    plans: list[PrefillSeqPlan] = []
    for s, (lo, hi) in enumerate(zip(seq_lo.tolist(), seq_hi.tolist(), strict=True)):
        plan = PrefillSeqPlan(
            int(rows[lo]), int(rows[hi - 1]) + 1, int(seq_lens[seq_of[lo]]), ids[s],
            tuple(groups[s]), key_start=int(start_block[s]) * block_size,
        )  # fmt: skip
        plans.append(plan)
    return tuple(plans)


def _plan_prefill(
    query_start: int,
    query_end: int,
    seq_len: int,
    table_row: torch.Tensor,
    block_size: int,
    window: int | None,
    chunk: int | None = None,
) -> PrefillSeqPlan:
    positions = np.arange(seq_len - (query_end - query_start), seq_len, dtype=np.int64)
    first_key, first_block, padded = _key_ranges(positions, block_size, window, chunk)
    # Runs of rows with the same key range share one gather of the sequence's blocks.
    change = (np.diff(first_block) != 0) | (np.diff(padded) != 0)
    bounds = [0, *(np.flatnonzero(change) + 1).tolist(), len(positions)]
    key_start_block = int(first_block[0])
    device = table_row.device
    groups: list[PrefillRowGroup] = []
    for lo, hi in itertools.pairwise(bounds):
        kv_len = int(padded[lo]) * block_size
        offset = int(first_block[lo]) * block_size
        mask = _mask(positions[lo:hi], first_key[lo:hi], np.full(hi - lo, offset), kv_len)
        groups.append(
            PrefillRowGroup(
                row_start=query_start + lo,
                row_end=query_start + hi,
                key_offset=offset - key_start_block * block_size,
                kv_len=kv_len,
                mask=torch.from_numpy(mask[:, None, None, :]).to(device),
            )
        )
    end_block = int((first_block + padded).max())
    block_index = torch.arange(key_start_block, end_block, device=device)
    block_index = block_index.clamp(max=table_row.shape[0] - 1)
    return PrefillSeqPlan(
        query_start, query_end, seq_len, table_row[block_index], tuple(groups),
        key_start=key_start_block * block_size,
    )  # fmt: skip
