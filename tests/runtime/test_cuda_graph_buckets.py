"""CUDA-graph batch-size buckets (pure Python). The padding rule is applied by
``runtime/worker/cuda_graphs.write_padded_decode`` and tested with it (test_cuda_runner.py,
and against the attention kernel in test_kernels_triton.py)."""

from __future__ import annotations

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
