"""The Llama-style model matches HF transformers logits for every supported family.

Float32 on CPU; logits must agree within 1e-4 (max abs) with identical argmax, for a fresh
prefill, a chunked prefill through the paged KV cache, and a mixed decode + prefill batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from forward_inputs import (
    Chunk,
    assert_logits_match,
    hf_logits,
    new_kv_caches,
    run_step,
    tokens_for,
)
from tiny_models import TINY_FAMILIES, TINY_VOCAB, build_tiny_model

from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model
from tokenwire.runtime.models.llama import LlamaForCausalLM

FAMILIES = sorted(TINY_FAMILIES)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[LoadedModel, Any]]:
    """(our loaded model, HF reference model) per (family, overrides), built once."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple[LoadedModel, Any]] = {}

    def get(family: str, **overrides: Any) -> tuple[LoadedModel, Any]:
        key = f"{family}{sorted(overrides.items())}"
        if key not in cache:
            path = build_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"), **overrides)
            ours = load_model(ModelConfig(model=str(path)), torch.device("cpu"), torch.float32)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[key] = (ours, hf)
        return cache[key]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_fresh_prefill_matches_hf(family: str, models: Callable[..., Any]) -> None:
    loaded, hf = models(family)
    tokens = tokens_for(0, 37)
    ours = run_step(loaded.model, new_kv_caches(loaded.model), [Chunk(tokens, 0, [5, 2, 7])])
    assert_logits_match(ours, hf_logits(hf, tokens))


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_through_paged_cache_matches_hf(
    family: str, models: Callable[..., Any]
) -> None:
    loaded, hf = models(family)
    tokens = tokens_for(1, 37)
    kv = new_kv_caches(loaded.model)
    blocks = [9, 3, 14]  # non-contiguous, out of order
    first = run_step(loaded.model, kv, [Chunk(tokens[:16], 0, blocks)])
    second = run_step(loaded.model, kv, [Chunk(tokens[16:], 16, blocks)])
    assert_logits_match(torch.cat([first, second]), hf_logits(hf, tokens))


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_decode_and_prefill_batch_matches_hf(family: str, models: Callable[..., Any]) -> None:
    loaded, hf = models(family)
    model = loaded.model
    kv = new_kv_caches(model)
    # Three sequences already in the cache (lengths 10, 17 and 33), each decoding one token,
    # batched with a fresh 20-token prefill.
    prompts = [tokens_for(10 + i, n) for i, n in enumerate((10, 17, 33))]
    tables = [[4], [11, 1], [6, 20, 13]]
    for prompt, table in zip(prompts, tables, strict=True):
        run_step(model, kv, [Chunk(prompt, 0, table)])
    next_tokens = [7, 8, 9]
    new_prompt = tokens_for(20, 20)
    step = [
        Chunk([tok], len(prompt), table)
        for prompt, tok, table in zip(prompts, next_tokens, tables, strict=True)
    ]
    step.append(Chunk(new_prompt, 0, [17, 2]))
    logits = run_step(model, kv, step)
    for row, (prompt, tok) in enumerate(zip(prompts, next_tokens, strict=True)):
        assert_logits_match(logits[row : row + 1], hf_logits(hf, [*prompt, tok])[-1:])
    assert_logits_match(logits[3:], hf_logits(hf, new_prompt))


def test_llama3_rope_scaling_matches_hf(models: Callable[..., Any]) -> None:
    loaded, hf = models("llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)
    assert loaded.arch.rope_scaling_dict() is not None
    assert loaded.arch.rope_scaling_dict()["rope_type"] == "llama3"  # type: ignore[index]
    tokens = tokens_for(2, 37)
    kv = new_kv_caches(loaded.model)
    first = run_step(loaded.model, kv, [Chunk(tokens[:16], 0, [3, 8, 1])])
    second = run_step(loaded.model, kv, [Chunk(tokens[16:], 16, [3, 8, 1])])
    assert_logits_match(torch.cat([first, second]), hf_logits(hf, tokens))


def test_tied_embeddings_share_storage(models: Callable[..., Any]) -> None:
    loaded, _ = models("qwen2")
    model: LlamaForCausalLM = loaded.model
    assert loaded.arch.tie_word_embeddings
    assert model.lm_head is None
    embed = model.model.embed_tokens.weight
    assert model.lm_head_weight is embed
    hidden = torch.randn(2, loaded.arch.hidden_size)
    with torch.no_grad():
        before = model.compute_logits(hidden)
        embed[5].add_(1.0)  # editing the embedding must move the logits of token 5 only
        after = model.compute_logits(hidden)
        embed[5].sub_(1.0)
    changed = (after - before).abs().amax(dim=0) > 0
    assert changed.nonzero().flatten().tolist() == [5]


def test_untied_model_has_separate_lm_head(models: Callable[..., Any]) -> None:
    loaded, hf = models("llama")
    model: LlamaForCausalLM = loaded.model
    assert model.lm_head is not None
    assert model.lm_head_weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head_weight, hf.lm_head.weight)


def test_logits_are_float32_and_shaped(models: Callable[..., Any]) -> None:
    loaded, _ = models("qwen3")
    hidden = torch.randn(3, loaded.arch.hidden_size)
    logits = loaded.model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    assert logits.shape == (3, TINY_VOCAB)
