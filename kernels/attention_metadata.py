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

# (sequence index in the step, first position, end position) of each image run whose rows
# attend bidirectionally within it (Gemma 3; ``AttentionMetadata.image_spans``).
ImageSpans = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, slots=True)
class PrefillRowGroup:
    """Consecutive prefill rows of one sequence whose keys span the same canonical range
    (``attention_plan``): attended as one batch of single-token queries over that range."""

    row_start: int  # rows [row_start, row_end) of query and output
    row_end: int
    key_offset: int  # first key of the range, in positions past the sequence's gather start
    kv_len: int  # the canonical padded length of the range
    mask: torch.Tensor  # bool [n, 1, 1, kv_len], True = may attend


@dataclass(frozen=True, slots=True)
class PrefillSeqPlan:
    """Precomputed gather for one prefill sequence (torch reference path)."""

    query_start: int
    query_end: int
    seq_len: int
    # int64: the blocks gathered once per layer for every group (from ``key_start`` on;
    # past the block table's end the index is clamped: those keys are masked).
    block_ids: torch.Tensor
    groups: tuple[PrefillRowGroup, ...]
    # First key position gathered (a multiple of the block size): a windowed row skips the
    # blocks wholly before its window.
    key_start: int = 0


@dataclass(frozen=True, slots=True)
class DecodeGroupPlan:
    """One-token query rows (decode rows, one-token remainders) whose keys span the same
    canonical padded length, gathered and attended as one batch.

    Grouping by length bounds the padding each row carries (the padded gather of K/V is the
    dominant cost of CPU decode attention), at the price of one gather per group.
    """

    rows: torch.Tensor  # int64 [n]: token indices of these rows in query and output
    block_ids: torch.Tensor  # int64 [n * max_blocks]: the rows' sequences' blocks, flattened
    max_blocks: int  # the canonical padded length of every row of the group, in blocks
    # Bool [n, 1, 1, max_blocks * block_size], True = may attend: the key position is
    # <= the row's position (and, for a windowed plan, > position - window; a windowed row's
    # gather starts at the block of its first key, so positions are relative to that block).
    mask: torch.Tensor


@dataclass(frozen=True, slots=True)
class CpuAttentionPlan:
    """Gather indices built once per step so every layer reuses them."""

    decode_groups: tuple[DecodeGroupPlan, ...]
    prefills: tuple[PrefillSeqPlan, ...]
    # (window, plan) for each sliding window of the model's layers (``attention_plan``).
    windowed: tuple[tuple[int, CpuAttentionPlan], ...] = ()
    # (chunk size, plan) for each attention chunk size of the model's chunked layers (Llama 4).
    chunked: tuple[tuple[int, CpuAttentionPlan], ...] = ()


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
    # Gemma 3's image runs in this step: (sequence index, first position, end position) of
    # each run whose rows attend bidirectionally within it (``kernels.image_attention``).
    image_spans: ImageSpans = ()
