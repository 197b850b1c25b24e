"""Batch layout for one forward pass over a flattened, paged batch.

Layout invariants (the model runner guarantees them):
- the batch is ``num_seqs`` sequences whose query tokens are concatenated into ``num_tokens``
  rows of ``query``/``key``/``value``; sequence ``i`` owns rows
  ``query_start_loc[i]:query_start_loc[i+1]``;
- sequences ``[0, num_decodes)`` have exactly one query token ("decode" rows, which includes a
  prefill whose last token is the only one left); the rest are prefill rows;
- ``seq_lens[i]`` is the context length *including* this step's query tokens, so the query
  tokens of sequence ``i`` sit at positions ``seq_lens[i] - query_len_i .. seq_lens[i] - 1``;
- ``block_tables[i, j]`` is the physical KV block holding positions ``j*block_size ..``;
  unused entries are 0 (the null block, never written);
- ``slot_mapping[t] = block * block_size + offset`` is where row ``t``'s K/V is stored;
  ``-1`` marks a padding row that must be skipped (CUDA-graph padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class PrefillSeqPlan:
    """Precomputed gather for one prefill sequence (torch reference path)."""

    query_start: int
    query_end: int
    seq_len: int
    block_ids: torch.Tensor  # int64 [ceil(seq_len / block_size)]
    # True when no earlier context exists (seq_len == query_len): attend to fresh K/V directly.
    fresh: bool
    # Bool [query_len, seq_len - key_start], True = may attend; None for plain causal
    # attention over this step's K/V (``fresh`` without a window that masks anything).
    mask: torch.Tensor | None
    # First key position gathered (a multiple of the block size): a windowed row skips the
    # blocks wholly before its first query's window. ``block_ids`` start at this position.
    key_start: int = 0


@dataclass(frozen=True, slots=True)
class DecodeGroupPlan:
    """Decode rows of similar context length, gathered and attended as one padded batch.

    Grouping by length bounds the padding each row carries (the padded gather of K/V is the
    dominant cost of CPU decode attention), at the price of one gather per group.
    """

    rows: torch.Tensor  # int64 [n]: indices of these decode rows in query and output
    block_ids: torch.Tensor  # int64 [n * max_blocks]: the rows' block tables, flattened
    max_blocks: int
    # Bool [n, 1, 1, max_blocks * block_size], True = may attend: the key position is
    # < seq_len (and, for a windowed plan, >= seq_len - window; a windowed row's gather
    # starts at the block of its first key, so positions are relative to that block).
    mask: torch.Tensor


@dataclass(frozen=True, slots=True)
class CpuAttentionPlan:
    """Gather indices built once per step so every layer reuses them."""

    decode_groups: tuple[DecodeGroupPlan, ...]
    prefills: tuple[PrefillSeqPlan, ...]
    # (window, plan) for each sliding window of the model's layers (``attention_plan``).
    windowed: tuple[tuple[int, CpuAttentionPlan], ...] = ()


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    num_tokens: int
    num_seqs: int
    num_decodes: int
    block_size: int
    slot_mapping: torch.Tensor  # int64 [>= num_tokens], -1 = padding
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    max_query_len: int
    max_seq_len: int
    # Host copies of the same values (numpy, no device sync needed to read them).
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    cpu_plan: CpuAttentionPlan | None = None
