"""CUDA-graph batch-size buckets and the decode padding rule (pure numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from tokenwire.kernels import cuda_graph_buckets as buckets


def test_decode_batch_buckets_ladder() -> None:
    assert buckets.decode_batch_buckets(1) == (1,)
    assert buckets.decode_batch_buckets(6) == (1, 2, 4, 6)
    assert buckets.decode_batch_buckets(24) == (1, 2, 4, 8, 16, 24)
    ladder = buckets.decode_batch_buckets(300)
    assert ladder[:5] == (1, 2, 4, 8, 16) and ladder[-4:] == (256, 272, 288, 300)
    assert list(ladder) == sorted(set(ladder))
    with pytest.raises(ValueError, match="max_num_seqs"):
        buckets.decode_batch_buckets(0)


def test_padded_batch_size_picks_smallest_bucket() -> None:
    ladder = buckets.decode_batch_buckets(100)
    assert [buckets.padded_batch_size(n, ladder) for n in (1, 3, 5, 8, 9, 97, 100)] == [
        1, 4, 8, 8, 16, 100, 100,
    ]  # fmt: skip
    assert buckets.padded_batch_size(101, ladder) is None
    every = {buckets.padded_batch_size(n, ladder) for n in range(1, 101)}
    assert every <= set(ladder)


def test_pad_decode_batch_rule() -> None:
    padded = buckets.pad_decode_batch(
        np.array([5, 6]), np.array([10, 3]), np.array([170, 51]), np.array([11, 4]),
        np.array([[10, 11], [3, 0]]), bucket=4, num_block_columns=3,
    )  # fmt: skip
    assert padded.num_real == 2
    assert padded.input_ids.tolist() == [5, 6, 0, 0]
    assert padded.positions.tolist() == [10, 3, 0, 0]
    assert padded.slot_mapping.tolist() == [170, 51, -1, -1]
    assert padded.seq_lens.tolist() == [11, 4, 0, 0]
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert padded.block_tables.tolist() == [[10, 11, 0], [3, 0, 0], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="does not fit"):
        buckets.pad_decode_batch(*(np.zeros(3) for _ in range(4)), np.zeros((3, 1)), bucket=2)
