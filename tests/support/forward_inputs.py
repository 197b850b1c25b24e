"""One model forward outside the engine: chunks of a batch, attention metadata, KV caches and
HF's logits for the same tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tiny_models import TINY_VOCAB

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.kv_quant import LayerKVCache
from tokenwire.kernels.paged_attention import build_cpu_plan
from tokenwire.runtime.models.llama import LlamaForCausalLM

BLOCK_SIZE = 16


NUM_BLOCKS = 24


ATOL = 1e-4


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
