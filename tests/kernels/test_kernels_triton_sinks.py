"""gpt-oss's attention sinks in the Triton paged-attention kernels (decode splits and prefill
tiles), under the CPU interpreter (compiled on CUDA), against the dense oracle and the batched
torch path (and a tiny gpt-oss's forward, every kernel in Triton, against the torch path):
a per-query-head sink logit joins each row's softmax as one more column
(``exp(sink - m)`` in the denominator, nothing in the numerator), with and without sliding
windows, for several block sizes, GQA groupings and decode split counts (the sink is added
once, at the split combine, so the split count must not matter)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from forward_inputs import Chunk, new_kv_caches, run_step, tokens_for
from kernel_inputs import DEVICE, ON_CUDA, make_attention_batch
from tiny_models import build_tiny_model

from tokenwire.kernels.paged_attention import (
    paged_attention,
    paged_attention_dense_ref,
    paged_attention_ref,
)
from tokenwire.kernels.paged_attention_triton import paged_attention_triton
from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.loader.model_loader import load_model

# 3 layers (sliding, full, sliding), a 6-token window, top-2 of 4 experts, a low swiglu_limit.
GPT_OSS: dict[str, Any] = dict(
    model_type="gpt_oss", hidden_size=64, intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    num_local_experts=4, num_experts_per_tok=2, sliding_window=6, swiglu_limit=3.0,
)  # fmt: skip
# Small on purpose: the interpreter runs every program in Python.
SHAPES = {
    "decode": [(1, 37), (1, 9), (1, 3)],
    "prefill": [(13, 13), (6, 30), (9, 22)],  # fresh, prefix hit, later chunk
    "mixed": [(1, 37), (1, 9), (11, 11), (5, 26), (1, 17)],
}


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch (``use_triton``) sees the interpreter switch only inside this module's tests."""
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    """Sinks from well below to well above typical scores, so some heads' sink dominates."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_heads, generator=gen) * 3).to(DEVICE)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize(
    ("case", "heads", "kv_heads", "block_size", "splits"),
    [
        ("decode", 4, 2, 8, 1),
        ("decode", 6, 2, 4, 3),  # GROUP 3: padded head rows; more splits than some contexts
        ("prefill", 4, 1, 8, 1),  # GROUP 4 (MQA)
        ("prefill", 2, 2, 16, 1),  # GROUP 1
        ("mixed", 4, 2, 8, 2),
    ],
)
def test_sinks_match_the_dense_oracle(
    case: str, heads: int, kv_heads: int, block_size: int, splits: int, window: int | None
) -> None:
    """Triton (small tiles: key walks cross tiles and windows start inside them) equals the
    float32 oracle; so do the public dispatch and, on CPU, the batched torch path. Padding
    rows come back as zeros, and the sinks change the result."""
    batch = make_attention_batch(SHAPES[case], heads, kv_heads, 16, block_size, padding_rows=2)
    query, key, value, k_cache, v_cache, meta = batch
    sinks = _sinks(heads, seed=heads + block_size)
    kw = dict(sliding_window=window, sinks=sinks)
    oracle = paged_attention_dense_ref(query, k_cache, v_cache, meta, 0.25, **kw)
    out = paged_attention_triton(
        query, k_cache, v_cache, meta, 0.25, num_splits=splits, block_m=16, block_n=16, **kw
    )
    torch.testing.assert_close(out, oracle, rtol=1e-4, atol=1e-5)
    assert out[-2:].abs().max() == 0.0
    dispatched = paged_attention(query, key, value, k_cache, v_cache, meta, 0.25, **kw)
    torch.testing.assert_close(dispatched, oracle, rtol=1e-4, atol=1e-5)
    if DEVICE.type == "cpu":
        ref = paged_attention_ref(query, key, value, k_cache, v_cache, meta, 0.25, **kw)
        torch.testing.assert_close(ref, oracle, rtol=1e-4, atol=1e-5)
    plain = paged_attention_dense_ref(query, k_cache, v_cache, meta, 0.25, sliding_window=window)
    assert (plain - oracle).abs().max() > 1e-2  # the sinks matter


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_decode_sink_is_added_once_whatever_the_split_count(splits: int) -> None:
    """A sink far above every score takes almost all of each row's weight: a sink added per
    split (not once at the combine) would shrink the output by the split count. Every split
    count equals the oracle; contexts shorter than the split count leave empty splits."""
    batch = make_attention_batch([(1, 40), (1, 2), (1, 19)], 4, 2, 16, 8)
    query, _, _, k_cache, v_cache, meta = batch
    sinks = torch.tensor([4.0, -1.0, 0.5, 2.0], device=DEVICE)
    oracle = paged_attention_dense_ref(query, k_cache, v_cache, meta, 0.25, sinks=sinks)
    out = paged_attention_triton(
        query, k_cache, v_cache, meta, 0.25, num_splits=splits, block_n=16, sinks=sinks
    )
    torch.testing.assert_close(out, oracle, rtol=1e-4, atol=1e-5)


def test_sinks_without_them_and_bad_shape() -> None:
    """``sinks=None`` keeps the plain kernels (equal to the sink-free oracle); a sinks tensor
    that is not one logit per query head is refused."""
    query, _, _, k_cache, v_cache, meta = make_attention_batch(SHAPES["mixed"], 4, 2, 16)
    out = paged_attention_triton(query, k_cache, v_cache, meta, 0.25, sliding_window=6)
    oracle = paged_attention_dense_ref(query, k_cache, v_cache, meta, 0.25, sliding_window=6)
    torch.testing.assert_close(out, oracle, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="sinks must be"):
        paged_attention_triton(
            query, k_cache, v_cache, meta, 0.25, sinks=torch.zeros(2, device=DEVICE)
        )


@pytest.mark.skipif(ON_CUDA, reason="compares the interpreter with the CPU torch path")
def test_gpt_oss_forward_in_triton_equals_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny gpt-oss (sliding / full layers, sinks, expert biases, clamped SwiGLU): a chunked
    prefill past the window, then a decode and a fresh prefill in one step, every kernel in
    Triton, equal to the torch path's logits within 1e-4."""
    path = build_tiny_model("llama", tmp_path, **GPT_OSS)
    model = load_model(ModelConfig(model=str(path)), torch.device("cpu"), torch.float32).model
    with torch.no_grad():  # sinks well away from zero, so they matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    tokens, fresh = tokens_for(1, 23), tokens_for(2, 9)
    steps = [
        [Chunk(tokens[:11], 0, [9, 3])],
        [Chunk(tokens[11:], 11, [9, 3])],
        [Chunk([7], 23, [9, 3]), Chunk(fresh, 0, [5])],
    ]

    def run() -> torch.Tensor:
        kv = new_kv_caches(model)
        return torch.cat([run_step(model, kv, chunks) for chunks in steps])

    monkeypatch.delenv("TRITON_INTERPRET")
    ref = run()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = run()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_sinks_bf16_gpt_oss_heads(window: int | None) -> None:
    """gpt-oss-20b's heads (64 q / 8 kv, head_dim 64) in bf16 with bf16 sinks: 32 decodes up to
    3k context with the default split count, a 700-token fresh prefill, a 300-token prefix
    hit on 1k cached, and padding rows, against the float32 oracle on the same inputs."""
    lens = torch.randint(1, 3000, (32,), generator=torch.Generator().manual_seed(5)).tolist()
    shape = [(1, n) for n in lens] + [(700, 700), (300, 1300)]
    query, _, _, k_cache, v_cache, meta = make_attention_batch(
        shape, 64, 8, 64, 16, padding_rows=3, dtype=torch.bfloat16
    )
    sinks = _sinks(64, seed=1).to(torch.bfloat16)
    out = paged_attention_triton(
        query, k_cache, v_cache, meta, 0.125, sliding_window=window, sinks=sinks
    )
    ref = paged_attention_dense_ref(
        query.float(), k_cache.float(), v_cache.float(), meta, 0.125, sliding_window=window,
        sinks=sinks.float(),
    )  # fmt: skip
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert not out[-3:].any()
