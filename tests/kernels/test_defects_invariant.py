"""Defects #20: on the default CPU path a row's logits do not depend on what else is batched.

The default model (SmolLM2-135M-Instruct GGUF: int4 linears on the VNNI kernel where the CPU
has it, else torch's bf16 int4 kernel; the int8 or bf16 LM head on the tied embedding; the
torch paged-attention path) runs one prompt alone,
replicated in batches of 1..8, next to other prompts and decodes, and split into chunks (as
chunked prefill and prefix caching do, down to a one-token remainder batched as a decode row).
Every shape must give the prompt's rows bit-identical logits.

At one torch thread: at two, torch's CPU attention gives a decode row other bits when it
runs next to another row (``test_defects_invariant_attention.py`` marks that xfail). Torch's
int4 kernel rounded each linear's input to bf16, which hid those bits here; the VNNI kernel
keeps ~15 bits of its input, so they reach the logits (measured: layer 0's attention output
is the first tensor that differs, with either kernel).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from forward_inputs import Chunk, make_meta

from tokenwire.kernels.kv_quant import LayerKVCache
from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.loader.model_loader import load_model
from tokenwire.runtime.models.decoder import MLP
from tokenwire.runtime.models.llama import LlamaForCausalLM

BLOCK = 16
NUM_BLOCKS = 96
ROW_COUNTS = range(1, 9)
OTHER_PROMPT_LENS = (5, 23, 64)

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    loaded = load_model(ModelConfig(), torch.device("cpu"), torch.float32)
    assert loaded.quantization == "gguf"  # the default: int4 linears kept quantized
    return loaded.model


@pytest.fixture(scope="module")
def prompt(model: LlamaForCausalLM) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(100, model.arch.vocab_size, (41,), generator=gen).tolist()


def new_caches(model: LlamaForCausalLM) -> list[LayerKVCache]:
    arch = model.arch
    shape = (NUM_BLOCKS, BLOCK, arch.num_key_value_heads, arch.head_dim)
    return [LayerKVCache(torch.zeros(shape), torch.zeros(shape)) for _ in model.model.layers]


@torch.no_grad()
def last_logits(
    model: LlamaForCausalLM, kv: list[LayerKVCache], chunks: Sequence[Chunk]
) -> torch.Tensor:
    """One forward over ``chunks`` (decode rows first); logits of each chunk's last row,
    computed for those rows only, as the runner does."""
    ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.int64)
    positions = torch.tensor(
        [c.start + j for c in chunks for j in range(len(c.tokens))], dtype=torch.int64
    )
    hidden = model(ids, positions, kv, make_meta(list(chunks), BLOCK))
    ends = torch.tensor([len(c.tokens) for c in chunks]).cumsum(0) - 1
    return model.compute_logits(hidden[ends])


def blocks(i: int, n: int = 6) -> list[int]:
    """Sequence ``i``'s own blocks (block 0 is the null block)."""
    return list(range(1 + i * n, 1 + (i + 1) * n))


def reference(model: LlamaForCausalLM, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(last prefill row's logits, next decode row's logits) of ``prompt`` alone."""
    kv = new_caches(model)
    first = last_logits(model, kv, [Chunk(prompt, 0, blocks(0))])[0]
    token = int(first.argmax())
    second = last_logits(model, kv, [Chunk([token], len(prompt), blocks(0))])[0]
    return first, second


def assert_rows_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    for i, row in enumerate(got):
        diff = (row - want).abs().max().item()
        assert torch.equal(row, want), f"{what}: row {i} differs (max abs diff {diff:.3g})"


def test_each_linear_and_the_lm_head_give_a_row_the_same_bits_in_any_batch(
    model: LlamaForCausalLM,
) -> None:
    """Rows replicated 1..8 times, and one row among 1..8, 16 and 64 others."""
    layer = model.model.layers[0]
    hidden = model.arch.hidden_size
    mlp = layer.mlp
    assert isinstance(mlp, MLP)
    ops = {
        "qkv_proj": (layer.self_attn.qkv_proj, hidden),
        "o_proj": (layer.self_attn.o_proj, hidden),
        "gate_up_proj": (mlp.gate_up_proj, hidden),
        "down_proj": (mlp.down_proj, model.arch.intermediate_size),
        "lm_head": (model.compute_logits, hidden),
    }
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, (op, width) in ops.items():
            row = torch.randn(1, width, generator=gen)
            others = torch.randn(64, width, generator=gen)
            want = op(row)[0]
            for n in ROW_COUNTS:
                assert_rows_equal(op(row.expand(n, width).contiguous()), want, f"{name} x{n}")
            for n in (*ROW_COUNTS, 16, 64):
                for at in sorted({0, n // 2, n - 1}):
                    batch = others[:n].clone()
                    batch[at] = row[0]
                    assert_rows_equal(op(batch)[at : at + 1], want, f"{name} at {at} of {n}")


def test_prompt_replicated_in_batches_of_1_to_8_gets_the_same_logits(
    model: LlamaForCausalLM, prompt: list[int]
) -> None:
    first, second = reference(model, prompt)
    token = int(first.argmax())
    for n in ROW_COUNTS:
        kv = new_caches(model)
        got = last_logits(model, kv, [Chunk(prompt, 0, blocks(i)) for i in range(n)])
        assert_rows_equal(got, first, f"prefill x{n}")
        decodes = [Chunk([token], len(prompt), blocks(i)) for i in range(n)]
        assert_rows_equal(last_logits(model, kv, decodes), second, f"decode x{n}")


def test_prompt_next_to_other_prompts_and_decodes_gets_the_same_logits(
    model: LlamaForCausalLM, prompt: list[int]
) -> None:
    first, second = reference(model, prompt)
    token = int(first.argmax())
    gen = torch.Generator().manual_seed(2)
    others = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in OTHER_PROMPT_LENS]
    kv = new_caches(model)
    chunks = [Chunk(p, 0, blocks(i + 1)) for i, p in enumerate(others)]
    chunks.insert(1, Chunk(prompt, 0, blocks(0)))
    got = last_logits(model, kv, chunks)
    assert_rows_equal(got[1:2], first, "prefill among other prefills")
    # Decodes of every sequence (the prompt's in the middle), then a fresh prompt.
    decodes = [Chunk([7], len(p), blocks(i + 1)) for i, p in enumerate(others)]
    decodes.insert(2, Chunk([token], len(prompt), blocks(0)))
    fresh = Chunk(others[2][:30], 0, blocks(len(others) + 1))
    got = last_logits(model, kv, [*decodes, fresh])
    assert_rows_equal(got[2:3], second, "decode among decodes and a prefill")


@pytest.mark.parametrize("cuts", [(32,), (16, 32), (40,), (8, 17, 33)])
def test_prompt_in_chunks_gets_the_same_logits(
    model: LlamaForCausalLM, prompt: list[int], cuts: tuple[int, ...]
) -> None:
    """Chunked prefill and prefix hits: earlier chunks come from the cache; (40,) leaves a
    one-token remainder, which the runner batches as a decode row."""
    first, _ = reference(model, prompt)
    kv = new_caches(model)
    got = None
    for lo, hi in zip((0, *cuts), (*cuts, len(prompt)), strict=True):
        got = last_logits(model, kv, [Chunk(prompt[lo:hi], lo, blocks(0))])
    assert got is not None
    assert_rows_equal(got, first, f"prefill in chunks cut at {cuts}")
