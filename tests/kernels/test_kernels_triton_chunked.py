"""Llama 4's chunked local attention in the Triton paged-attention kernels (decode splits and
prefill tiles), under the CPU interpreter (compiled on CUDA), against the dense oracle: the
query at ``q`` sees keys ``q // C * C <= k <= q``."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import ATTENTION_CASES, DEVICE, ON_CUDA, make_attention_batch

from tokenwire.kernels.paged_attention import (
    paged_attention,
    paged_attention_dense_ref,
    paged_attention_ref,
)
from tokenwire.kernels.paged_attention_triton import paged_attention_triton


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch (``use_triton``) sees the interpreter switch only inside this module's tests."""
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("chunk", [5, 8, 16, 40])
def test_chunked_attention_matches_the_dense_oracle(chunk: int) -> None:
    """Chunks shorter than, equal to and spanning several blocks of 8; small tiles so a key
    walk starts inside a tile and decode splits cross chunk starts. The batched CPU reference
    (chunk plans) and the public dispatch agree with the same oracle."""
    batch = make_attention_batch(ATTENTION_CASES["mixed"], 6, 2, 32, block_size=8)
    query, key, value, k_cache, v_cache, meta = batch
    oracle = paged_attention_dense_ref(query, k_cache, v_cache, meta, 0.25, attention_chunk=chunk)
    out = paged_attention_triton(
        query, k_cache, v_cache, meta, 0.25, block_m=16, block_n=16, num_splits=3,
        attention_chunk=chunk,
    )  # fmt: skip
    torch.testing.assert_close(out, oracle, rtol=1e-4, atol=1e-5)
    dispatched = paged_attention(
        query, key, value, k_cache, v_cache, meta, 0.25, attention_chunk=chunk
    )
    torch.testing.assert_close(dispatched, oracle, rtol=1e-4, atol=1e-5)
    full = paged_attention_dense_ref(query, k_cache, v_cache, meta, 0.25)
    assert not torch.allclose(full, oracle, rtol=1e-3, atol=1e-3)  # the chunks matter
    if DEVICE.type == "cpu":
        ref = paged_attention_ref(
            query, key, value, k_cache, v_cache, meta, 0.25, attention_chunk=chunk
        )
        torch.testing.assert_close(ref, oracle, rtol=1e-4, atol=1e-5)
