"""``kernels.image_attention`` (Gemma 3's image runs) against a dense oracle with HF's mask:
a row at ``p`` sees key ``k`` when (``k <= p`` or both lie in one image run) and, on a
sliding layer, ``k > p - window``. Rows outside every run keep ``paged_attention``'s causal
result. The batch holds a decode, a fresh prefill with two runs and a prefix-hit prefill whose
run began in the cached part (its earlier rows not recomputed), over scattered paged blocks,
with GQA, with and without a soft-cap."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_inputs import make_attention_batch

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.image_attention import image_run_attention
from tokenwire.kernels.paged_attention import paged_attention_ref

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 16
SHAPE = [(1, 21), (40, 40), (12, 48)]  # (query_len, seq_len)
# (sequence, run start, run end): two runs in the fresh prefill; one the prefix hit's step
# finishes (positions 30..35 cached, 36..43 in the step).
SPANS = ((1, 5, 21), (1, 24, 36), (2, 30, 44))


def _dense(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    out = torch.zeros_like(query)
    scale = DIM**-0.5
    for seq in range(meta.num_seqs):
        lo, hi = int(meta.query_start_loc_np[seq]), int(meta.query_start_loc_np[seq + 1])
        seq_len = int(meta.seq_lens_np[seq])
        slots = [
            int(meta.block_tables[seq, p // BLOCK]) * BLOCK + p % BLOCK for p in range(seq_len)
        ]
        k = k_cache.view(-1, KV_HEADS, DIM)[slots].repeat_interleave(HEADS // KV_HEADS, 1)
        v = v_cache.view(-1, KV_HEADS, DIM)[slots].repeat_interleave(HEADS // KV_HEADS, 1)
        for row in range(lo, hi):
            p = seq_len - (hi - row)
            keys = torch.arange(seq_len)
            allowed = keys <= p
            for s, start, end in SPANS:
                if s == seq and start <= p < end:
                    allowed |= (keys >= start) & (keys < end)
            if window is not None:
                allowed &= keys > p - window
            scores = torch.einsum("hd,khd->hk", query[row], k) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[row] = torch.einsum("hk,khd->hd", weights, v)
    return out


@pytest.mark.parametrize("window", [None, 8], ids=["full", "sliding"])
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
def test_image_runs_match_the_dense_mask(window: int | None, softcap: float | None) -> None:
    query, key, value, k_cache, v_cache, meta = make_attention_batch(
        SHAPE, HEADS, KV_HEADS, DIM, BLOCK, seed=3
    )
    meta = dataclasses.replace(meta, image_spans=SPANS)
    scale = DIM**-0.5
    out = paged_attention_ref(
        query, key, value, k_cache, v_cache, meta, scale,
        logits_soft_cap=softcap, sliding_window=window,
    )  # fmt: skip
    causal = out.clone()
    image_run_attention(
        query, k_cache, v_cache, meta, out, scale,
        logits_soft_cap=softcap, sliding_window=window,
    )  # fmt: skip
    torch.testing.assert_close(out, _dense(query, k_cache, v_cache, meta, window, softcap))
    # Only rows inside a run changed: the text rows (and the decode) keep the causal result.
    # Rows: the decode, then the fresh prefill's 40 (positions 0..39), then the prefix hit's
    # 12 (positions 36..47).
    inside = [1 + p for p in range(40) if 5 <= p < 21 or 24 <= p < 36]
    inside += [41 + p - 36 for p in range(36, 44)]  # the prefix hit's run rows in the step
    outside = [r for r in range(out.shape[0]) if r not in inside]
    torch.testing.assert_close(out[outside], causal[outside], rtol=0, atol=0)
    assert not torch.allclose(out[inside], causal[inside])
