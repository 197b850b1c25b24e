"""Llama 4's chunked local attention in the Triton paged-attention kernels (decode splits and
prefill tiles), under the CPU interpreter (compiled on CUDA), against the dense oracle: the
query at ``q`` sees keys ``q // C * C <= k <= q``; and a tiny Llama 4's forward with every
kernel in Triton against the torch path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from forward_inputs import Chunk, new_kv_caches, run_step, tokens_for
from kernel_inputs import ATTENTION_CASES, DEVICE, ON_CUDA, make_attention_batch
from tiny_models import build_tiny_model

from tokenwire.kernels.paged_attention import (
    paged_attention,
    paged_attention_dense_ref,
    paged_attention_ref,
)
from tokenwire.kernels.paged_attention_triton import paged_attention_triton
from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.loader.model_loader import load_model

# 4 layers: chunked-rope MoE, NoPE dense, chunked-rope dense, NoPE MoE (as tests/runtime).
LLAMA4 = dict(
    model_type="llama4_text", hidden_size=64, intermediate_size=32, intermediate_size_mlp=48,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=512, num_local_experts=4, num_experts_per_tok=1,
    moe_layers=[0, 3], no_rope_layer_interval=2, attention_chunk_size=8, floor_scale=4,
    attn_scale=0.5, rope_theta=500000.0,
)  # fmt: skip


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


@pytest.mark.skipif(ON_CUDA, reason="compares the interpreter with the CPU torch path")
def test_llama4_forward_in_triton_equals_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunked prefill, then a decode and a fresh prefill in one step, every kernel
    (attention with chunks, input-scaled MoE, rotary, norms) in Triton: equal to the torch
    path's logits within 1e-4."""
    path = build_tiny_model("llama", tmp_path, **LLAMA4)
    model = load_model(ModelConfig(model=str(path)), torch.device("cpu"), torch.float32).model
    tokens, fresh = tokens_for(1, 29), tokens_for(2, 11)
    steps = [
        [Chunk(tokens[:13], 0, [9, 3])],
        [Chunk(tokens[13:], 13, [9, 3])],
        [Chunk([7], 29, [9, 3]), Chunk(fresh, 0, [5])],
    ]

    def run() -> torch.Tensor:
        kv = new_kv_caches(model)
        return torch.cat([run_step(model, kv, chunks) for chunks in steps])

    monkeypatch.delenv("TRITON_INTERPRET")
    ref = run()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = run()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
