"""The Llama-style model matches HF transformers logits for every supported family.

Float32 on CPU; logits must agree within 1e-4 (max abs) with identical argmax, for a fresh
prefill, a chunked prefill through the paged KV cache, and a mixed decode + prefill batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from conftest import TINY_FAMILIES, TINY_VOCAB, build_tiny_model

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.kv_quant import LayerKVCache
from tokenwire.kernels.paged_attention import build_cpu_plan
from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model
from tokenwire.runtime.models.llama import LlamaForCausalLM

BLOCK_SIZE = 16
NUM_BLOCKS = 24
ATOL = 1e-4
FAMILIES = sorted(TINY_FAMILIES)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)


@dataclass(frozen=True)
class Chunk:
    """One sequence's share of a step: ``tokens`` at positions ``start .. start+len-1``."""

    tokens: Sequence[int]
    start: int
    block_ids: Sequence[int]  # the sequence's whole block table


def make_meta(chunks: Sequence[Chunk], block_size: int = BLOCK_SIZE) -> AttentionMetadata:
    """AttentionMetadata for ``chunks`` (decode rows, i.e. single tokens, must come first)."""
    query_lens = [len(c.tokens) for c in chunks]
    num_decodes = 0
    while num_decodes < len(chunks) and query_lens[num_decodes] == 1:
        num_decodes += 1
    assert all(q > 1 for q in query_lens[num_decodes:]), "decode rows must come first"
    seq_lens = np.array([c.start + len(c.tokens) for c in chunks], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    width = max(len(c.block_ids) for c in chunks)
    tables = torch.zeros(len(chunks), width, dtype=torch.int32)
    slots: list[int] = []
    for i, c in enumerate(chunks):
        tables[i, : len(c.block_ids)] = torch.tensor(c.block_ids, dtype=torch.int32)
        for pos in range(c.start, c.start + len(c.tokens)):
            slots.append(c.block_ids[pos // block_size] * block_size + pos % block_size)
    plan = build_cpu_plan(qsl, seq_lens, tables, num_decodes, block_size)
    return AttentionMetadata(
        num_tokens=int(qsl[-1]),
        num_seqs=len(chunks),
        num_decodes=num_decodes,
        block_size=block_size,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq_lens),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_np=qsl,
        seq_lens_np=seq_lens,
        cpu_plan=plan,
    )


def new_kv_caches(model: LlamaForCausalLM) -> list[LayerKVCache]:
    arch = model.arch
    shape = (NUM_BLOCKS, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
    return [
        LayerKVCache(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_hidden_layers)
    ]


@torch.no_grad()
def run_step(model: LlamaForCausalLM, kv: list[LayerKVCache], chunks: list[Chunk]) -> torch.Tensor:
    """One forward over ``chunks``; float32 logits for every query row [T, vocab]."""
    ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.int64)
    positions = torch.tensor(
        [c.start + j for c in chunks for j in range(len(c.tokens))], dtype=torch.int64
    )
    hidden = model(ids, positions, kv, make_meta(chunks))
    return model.compute_logits(hidden)


@torch.no_grad()
def hf_logits(hf_model: Any, tokens: Sequence[int]) -> torch.Tensor:
    out = hf_model(torch.tensor([list(tokens)], dtype=torch.int64))
    return out.logits[0].float()


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"max abs logit diff {diff:.3e} > {ATOL}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def tokens_for(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist()


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
