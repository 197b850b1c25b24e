"""Batch-size buckets for decode CUDA graphs, and how a decode batch is padded to its bucket.

A CUDA graph replays fixed shapes, so decode steps are captured for a ladder of batch sizes
(vLLM's ladder: 1, 2, 4, then steps of 8, then steps of 16 from 256) and a step with ``n``
sequences replays the smallest bucket ``>= n``. Every size up to ``max_num_seqs`` has a bucket
because ``max_num_seqs`` itself is always the last one.

Padding rows are harmless one-token decodes (``AttentionMetadata``'s layout holds, with
``num_decodes = bucket``): token 0 at position 0, ``slot_mapping = -1`` (``store_kv`` skips
it), ``seq_len = 0`` (the split-KV decode kernel reads no key and writes zeros) and a block
table row of the null block. Pure numpy: no torch, no device.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

PAD_TOKEN_ID = 0
PAD_POSITION = 0
PAD_SLOT = -1
PAD_SEQ_LEN = 0
NULL_BLOCK = 0

_SMALL = (1, 2, 4)
_STEP = 8
_WIDE_FROM = 256  # from here the ladder steps by _WIDE_STEP
_WIDE_STEP = 16


def decode_batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Ascending capture sizes: 1, 2, 4, 8, 16, ..., 256, 272, ..., and ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    ladder = [
        *_SMALL,
        *range(_STEP, _WIDE_FROM, _STEP),
        *range(_WIDE_FROM, max_num_seqs, _WIDE_STEP),
    ]
    return (*(b for b in ladder if b < max_num_seqs), max_num_seqs)


def padded_batch_size(num_seqs: int, buckets: tuple[int, ...]) -> int | None:
    """Smallest bucket ``>= num_seqs``; None when it exceeds every bucket (run eagerly)."""
    if num_seqs < 1:
        raise ValueError(f"num_seqs must be >= 1, got {num_seqs}")
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True, slots=True)
class PaddedDecodeBatch:
    """Decode inputs of ``bucket`` rows; rows ``[num_real, bucket)`` are padding."""

    num_real: int
    input_ids: np.ndarray  # int64 [bucket]
    positions: np.ndarray  # int64 [bucket]
    slot_mapping: np.ndarray  # int64 [bucket]
    seq_lens: np.ndarray  # int32 [bucket]
    query_start_loc: np.ndarray  # int32 [bucket + 1] = 0, 1, ..., bucket
    block_tables: np.ndarray  # int32 [bucket, num_block_columns]


def pad_decode_batch(
    input_ids: np.ndarray,
    positions: np.ndarray,
    slot_mapping: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    bucket: int,
    num_block_columns: int | None = None,
) -> PaddedDecodeBatch:
    """Pad a pure-decode batch of ``n`` rows to ``bucket`` rows (and block-table columns).

    ``num_block_columns`` widens the block table to a fixed width (a captured graph's buffer
    is sized for ``max_model_len``); extra columns hold the null block.
    """
    n = len(seq_lens)
    columns = block_tables.shape[1] if num_block_columns is None else num_block_columns
    if n > bucket:
        raise ValueError(f"batch of {n} does not fit bucket {bucket}")
    if block_tables.shape[1] > columns:
        raise ValueError(f"block table has {block_tables.shape[1]} columns, more than {columns}")
    tables = np.full((bucket, columns), NULL_BLOCK, dtype=np.int32)
    tables[:n, : block_tables.shape[1]] = block_tables
    return PaddedDecodeBatch(
        num_real=n,
        input_ids=_pad(input_ids, bucket, PAD_TOKEN_ID, np.int64),
        positions=_pad(positions, bucket, PAD_POSITION, np.int64),
        slot_mapping=_pad(slot_mapping, bucket, PAD_SLOT, np.int64),
        seq_lens=_pad(seq_lens, bucket, PAD_SEQ_LEN, np.int32),
        query_start_loc=np.arange(bucket + 1, dtype=np.int32),
        block_tables=tables,
    )


def _pad(values: np.ndarray, size: int, fill: int, dtype: type[np.generic]) -> np.ndarray:
    out = np.full(size, fill, dtype=dtype)
    out[: len(values)] = values
    return out
