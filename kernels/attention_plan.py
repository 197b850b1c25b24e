"""Per-step gather plans of the torch paged-attention path (``CpuAttentionPlan``).

``build_cpu_plan`` runs once per step and turns block tables into gather indices and masks
that every layer reuses. Models with sliding-window layers get one extra plan per distinct
window: a windowed decode row gathers only the blocks holding its last ``window`` positions
(so its cost no longer grows with the context) and its mask drops the keys before the window;
a windowed prefill row's mask allows key ``k`` for query ``q`` when ``q - window < k <= q``
(HF's ``sliding_window_overlay``).
"""

from __future__ import annotations

import numpy as np
import torch

from tokenwire.kernels.attention_metadata import (
    CpuAttentionPlan,
    DecodeGroupPlan,
    PrefillSeqPlan,
)

# Decode rows are bucketed by padded context length so one group's gather wastes little:
# buckets are 32 key positions wide below 256 and 12.5% wide above. Measured on 2 shared CPU
# cores, SmolLM2 shapes, 64 decodes with context U[32, 380]: one padded group per batch is
# 2-3x slower than ~8 length groups (the gather of padded K/V dominates); between 6 and 21
# groups the time is flat, so the exact widths matter little.
_LINEAR_BUCKET_TOKENS = 32
_GEOMETRIC_FROM_TOKENS = 256
_GEOMETRIC_RATIO = 1.125


def build_cpu_plan(
    query_start_loc_np: np.ndarray,
    seq_lens_np: np.ndarray,
    block_tables: torch.Tensor,
    num_decodes: int,
    block_size: int,
    windows: tuple[int, ...] = (),
) -> CpuAttentionPlan:
    """Precompute per-step gathers so each layer only indexes and calls sdpa.

    Rows ``[0, num_decodes)`` must have exactly one query token each. ``windows``: the
    distinct sliding windows of the model's layers; each gets its own plan in ``windowed``.
    """
    tables = block_tables.to(torch.int64)  # once per step: index_select wants int64
    full = _plan(query_start_loc_np, seq_lens_np, tables, num_decodes, block_size, None)
    windowed = tuple(
        (w, _plan(query_start_loc_np, seq_lens_np, tables, num_decodes, block_size, w))
        for w in sorted(set(windows))
    )
    return CpuAttentionPlan(full.decode_groups, full.prefills, windowed)


def plan_for_window(plan: CpuAttentionPlan, window: int | None) -> CpuAttentionPlan | None:
    """The plan of layers with attention window ``window`` (None: full attention); None when
    ``plan`` was built without that window."""
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
) -> CpuAttentionPlan:
    num_seqs = len(query_start_loc_np) - 1
    decode_groups = _plan_decode_groups(
        np.asarray(seq_lens_np[:num_decodes], dtype=np.int64), tables, block_size, window
    )
    prefills = tuple(
        _plan_prefill(
            int(query_start_loc_np[i]),
            int(query_start_loc_np[i + 1]),
            int(seq_lens_np[i]),
            tables[i],
            block_size,
            window,
        )
        for i in range(num_decodes, num_seqs)
    )
    return CpuAttentionPlan(decode_groups=decode_groups, prefills=prefills)


def _bucket_keys(padded_lens: np.ndarray) -> np.ndarray:
    """Bucket id per row (vectorised; larger id = longer context)."""
    linear = padded_lens // _LINEAR_BUCKET_TOKENS
    ratio = np.maximum(padded_lens, _GEOMETRIC_FROM_TOKENS) / _GEOMETRIC_FROM_TOKENS
    geometric = _GEOMETRIC_FROM_TOKENS // _LINEAR_BUCKET_TOKENS + np.floor(
        np.log(ratio) / np.log(_GEOMETRIC_RATIO)
    ).astype(np.int64)
    return np.where(padded_lens < _GEOMETRIC_FROM_TOKENS, linear, geometric)


def _plan_decode_groups(
    seq_lens: np.ndarray, tables: torch.Tensor, block_size: int, window: int | None
) -> tuple[DecodeGroupPlan, ...]:
    if len(seq_lens) == 0:
        return ()
    # A windowed row's first key position is seq_len - window; it gathers from that block on.
    first_key = np.zeros_like(seq_lens) if window is None else np.maximum(seq_lens - window, 0)
    first_block = first_key // block_size
    num_blocks = -(-seq_lens // block_size) - first_block  # ceil division
    keys = _bucket_keys(num_blocks * block_size)
    order = np.argsort(-keys, kind="stable")  # longest buckets first
    splits = np.flatnonzero(np.diff(keys[order])) + 1
    # Built in numpy and converted once per group: this runs every step on the host.
    tables_np = tables.numpy() if tables.device.type == "cpu" else tables.cpu().numpy()
    width = tables_np.shape[1]
    groups: list[DecodeGroupPlan] = []
    for rows_np in np.split(order, splits):
        rows_np = np.ascontiguousarray(rows_np)
        max_blocks = int(num_blocks[rows_np].max())
        block_index = first_block[rows_np][:, None] + np.arange(max_blocks)[None, :]
        # Past a row's last block the index may run off the table: those keys are masked.
        block_index = np.minimum(block_index, width - 1)
        block_ids = np.take_along_axis(tables_np[rows_np], block_index, axis=1).reshape(-1)
        key_pos = (first_block[rows_np] * block_size)[:, None] + np.arange(max_blocks * block_size)[
            None, :
        ]
        mask = (key_pos < seq_lens[rows_np][:, None]) & (key_pos >= first_key[rows_np][:, None])
        groups.append(
            DecodeGroupPlan(
                rows=torch.from_numpy(rows_np).to(tables.device),
                block_ids=torch.from_numpy(np.ascontiguousarray(block_ids)).to(tables.device),
                max_blocks=max_blocks,
                mask=torch.from_numpy(mask[:, None, None, :]).to(tables.device),
            )
        )
    return tuple(groups)


def _plan_prefill(
    query_start: int,
    query_end: int,
    seq_len: int,
    table_row: torch.Tensor,
    block_size: int,
    window: int | None,
) -> PrefillSeqPlan:
    query_len = query_end - query_start
    first_query = seq_len - query_len  # absolute position of the first query token
    fresh = query_len == seq_len
    # A window longer than the whole sequence masks nothing: plain causal attention.
    if window is not None and window >= seq_len:
        window = None
    key_start = 0
    if window is not None and not fresh:
        key_start = max(first_query - window + 1, 0) // block_size * block_size
    block_ids = table_row[key_start // block_size : -(-seq_len // block_size)]
    mask = None
    if not fresh or window is not None:
        # Query j sits at absolute position first_query + j and sees keys <= it (and, with a
        # window, keys > it - window); fresh rows attend to this step's K/V, from position 0.
        device = table_row.device
        query_pos = torch.arange(first_query, seq_len, device=device)
        key_pos = torch.arange(key_start, seq_len, device=device)
        mask = key_pos[None, :] <= query_pos[:, None]
        if window is not None:
            mask &= key_pos[None, :] > query_pos[:, None] - window
    return PrefillSeqPlan(query_start, query_end, seq_len, block_ids, fresh, mask, key_start)
