"""Batch-size buckets for decode CUDA graphs, and the values a padding row holds.

A CUDA graph replays fixed shapes, so decode steps are captured for a ladder of batch sizes
(vLLM's ladder: 1, 2, 4, then steps of 8, then steps of 16 from 256) and a step with ``n``
sequences replays the smallest bucket ``>= n``. Every size up to ``max_num_seqs`` has a bucket
because ``max_num_seqs`` itself is always the last one.

Padding rows are harmless one-token decodes (``AttentionMetadata``'s layout holds, with
``num_decodes = bucket``): token 0 at position 0, ``slot_mapping = -1`` (``store_kv`` skips
it) and ``seq_len = 0`` (the split-KV decode kernel reads no key and writes zeros), so their
block-table row is never read. ``runtime/worker/cuda_graphs.write_padded_decode`` applies these
values. Pure Python: no torch, no device.
"""

from __future__ import annotations

import bisect

PAD_TOKEN_ID = 0
PAD_POSITION = 0
PAD_SLOT = -1
PAD_SEQ_LEN = 0

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
