"""Inputs for attention kernels: paged KV caches, block tables, metadata and random batches
on the test device. Imports no Triton: kernel test modules set the interpreter switch first."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.paged_attention import (
    build_cpu_plan,
)
from tokenwire.kernels.store_kv import store_kv_ref

# (query_len, seq_len, block_ids): one sequence of a step, as the scheduler hands it over.
Seq = tuple[int, int, list[int]]


def build_metadata(
    seqs: Sequence[Seq], block_size: int, num_padding_rows: int = 0, with_plan: bool = True
) -> AttentionMetadata:
    """AttentionMetadata for ``seqs``; leading one-token sequences count as decodes."""
    query_lens = np.array([q for q, _, _ in seqs], dtype=np.int32)
    seq_lens = np.array([s for _, s, _ in seqs], dtype=np.int32)
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_decodes = 0
    while num_decodes < len(seqs) and query_lens[num_decodes] == 1:
        num_decodes += 1
    # One spare column of zeros: unused block-table entries point at the null block.
    max_blocks = max(len(ids) for _, _, ids in seqs) + 1
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    for i, (query_len, seq_len, ids) in enumerate(seqs):
        assert len(ids) == math.ceil(seq_len / block_size)
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(seq_len - query_len, seq_len):
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
    slots += [-1] * num_padding_rows
    plan = None
    if with_plan:
        plan = build_cpu_plan(query_start_loc, seq_lens, block_tables, num_decodes, block_size)
    return AttentionMetadata(
        num_tokens=len(slots),
        num_seqs=len(seqs),
        num_decodes=num_decodes,
        block_size=block_size,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.from_numpy(query_start_loc),
        seq_lens=torch.from_numpy(seq_lens),
        block_tables=block_tables,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_np=query_start_loc,
        seq_lens_np=seq_lens,
        cpu_plan=plan,
    )


def scatter_blocks(
    shape: Sequence[tuple[int, int]], block_size: int, gen: torch.Generator
) -> tuple[list[Seq], int]:
    """Give each (query_len, seq_len) distinct, unsorted, non-contiguous physical blocks."""
    needed = [math.ceil(s / block_size) for _, s in shape]
    num_blocks = 1 + 2 * sum(needed)  # twice what is needed: holes between used blocks
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    seqs: list[Seq] = []
    for (query_len, seq_len), n in zip(shape, needed, strict=True):
        seqs.append((query_len, seq_len, free[:n]))
        free = free[n:]
    return seqs, num_blocks


def new_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random contents stand for stale K/V of earlier owners; the null block is zeros."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    k_cache[0] = 0.0
    v_cache[0] = 0.0
    return k_cache, v_cache


ON_CUDA = torch.cuda.is_available()


DEVICE = torch.device("cuda" if ON_CUDA else "cpu")


def new_gen(seed: int) -> torch.Generator:
    """A generator on DEVICE: GPU tests draw large caches on the GPU, not through the host."""
    return torch.Generator(device=DEVICE).manual_seed(seed)


def rand(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=gen.device).to(dtype)


# (query_len, seq_len) per sequence; leading one-token sequences are decodes.
DECODES = [(1, 37), (1, 16), (1, 200), (1, 5), (1, 129)]


ATTENTION_CASES = {
    "decode": DECODES,
    "fresh_prefill": [(40, 40), (7, 7)],
    "prefix_hit": [(5, 37), (16, 48)],  # query shorter than its context (cached blocks)
    "chunked_prefill": [(24, 24), (24, 48), (9, 57)],  # first, middle and last chunks
    "mixed": [*DECODES, (20, 20), (13, 50), (1, 33), (16, 48), (3, 3)],
}


def make_attention_batch(
    shape: Sequence[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    padding_rows: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(query, key, value, k_cache, v_cache, metadata) after this step's K/V were stored.

    Each sequence gets distinct, shuffled block ids with unused blocks between them (holes);
    the caches start random (stale K/V of earlier owners) except the null block.
    """
    gen = new_gen(seed)
    needed = [math.ceil(s / block_size) for _, s in shape]
    num_blocks = 1 + 2 * sum(needed)
    host_gen = torch.Generator().manual_seed(seed)
    free = (torch.randperm(num_blocks - 1, generator=host_gen) + 1).tolist()
    k_cache, v_cache = (rand(num_blocks, block_size, num_kv_heads, head_dim, gen=gen, dtype=dtype)
                        for _ in range(2))  # fmt: skip
    k_cache[0] = 0.0
    v_cache[0] = 0.0
    tables = np.zeros((len(shape), max(needed) + 1), dtype=np.int32)  # + a null column
    slots: list[int] = []
    for i, ((query_len, seq_len), n) in enumerate(zip(shape, needed, strict=True)):
        tables[i, :n], free = free[:n], free[n:]
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size
                  for p in range(seq_len - query_len, seq_len)]  # fmt: skip
    slots += [-1] * padding_rows
    meta = build_meta(shape, tables, slots, block_size)
    num_tokens = len(slots)
    query = rand(num_tokens, num_heads, head_dim, gen=gen, dtype=dtype)
    key, value = (rand(num_tokens, num_kv_heads, head_dim, gen=gen, dtype=dtype)
                  for _ in range(2))  # fmt: skip
    store_kv_ref(key, value, k_cache, v_cache, meta.slot_mapping)
    return query, key, value, k_cache, v_cache, meta


def build_meta(
    shape: Sequence[tuple[int, int]], tables: np.ndarray, slots: list[int], block_size: int
) -> AttentionMetadata:
    query_lens = np.array([q for q, _ in shape], dtype=np.int32)
    seq_lens = np.array([s for _, s in shape], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_decodes = int(np.argmax(np.append(query_lens, 0) != 1))  # leading 1-token rows
    return AttentionMetadata(
        num_tokens=len(slots),
        num_seqs=len(shape),
        num_decodes=num_decodes,
        block_size=block_size,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.from_numpy(qsl).to(DEVICE),
        seq_lens=torch.from_numpy(seq_lens).to(DEVICE),
        block_tables=torch.from_numpy(tables).to(DEVICE),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_np=qsl,
        seq_lens_np=seq_lens,
    )
