"""The Triton MLA decode kernel (``kernels.mla_decode_triton``) against the torch reference
(``paged_attention_ref`` on the latent cache as one MQA head, values = keys) and a dense
float64 oracle (plain softmax attention over each row's gathered latents).

Under the CPU interpreter without CUDA (the module's fixture sets ``TRITON_INTERPRET=1``),
compiled on CUDA. Latent widths are DeepSeek's layout scaled down: ``kv_lora_rank`` latent
features then ``rope`` rotary features per cached token, one KV head.
"""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import ATTENTION_CASES, DECODES, ON_CUDA, make_attention_batch

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.kv_quant import quantize_fp8
from tokenwire.kernels.mla_attention import mla_attention, mla_attention_dense_ref
from tokenwire.kernels.mla_decode_triton import (
    head_block,
    mla_attention_triton,
    mla_decode_attention,
)
from tokenwire.kernels.paged_attention import paged_attention_ref

SCALE = 0.125


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def latent_batch(
    shape: list[tuple[int, int]], heads: int, lora: int, rope: int, dtype: torch.dtype,
    padding_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:  # fmt: skip
    """(query [T, heads, lora + rope], latent cache [blocks, 16, 1, lora + rope], metadata)."""
    query, _, _, cache, _, meta = make_attention_batch(
        shape, heads, 1, lora + rope, padding_rows=padding_rows, dtype=dtype
    )
    return query, cache, meta


def torch_ref(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
              lora: int, scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    out = paged_attention_ref(query, query, query, cache, cache, meta, SCALE, scale, scale)
    return out[..., :lora]


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= rtol * max(ref.float().abs().max().item(), 1e-6), err


@pytest.mark.parametrize(
    ("heads", "lora", "rope", "splits", "block_n"),
    [
        (4, 32, 8, 1, None),  # one split: the whole context in one program
        (4, 32, 8, 3, 8),  # split-K, tiles of 8 inside blocks of 16
        (20, 48, 16, 4, 16),  # padded latent lanes (48 -> 64), one head group of 32
        (80, 32, 8, 2, 32),  # two head groups of 64 (DeepSeek-V3's 128 heads split by TP=2)
    ],
)
def test_decode_kernel_equals_reference_and_oracle_fp32(
    heads: int, lora: int, rope: int, splits: int, block_n: int | None
) -> None:
    """Rows of different lengths (5 to 200: inside one block, exactly one block, many
    blocks and a partial last one), float32: kernel == torch reference == dense oracle."""
    query, cache, meta = latent_batch(DECODES, heads, lora, rope, torch.float32)
    out = torch.full((len(DECODES), heads, lora), float("nan"), device=query.device)
    mla_decode_attention(
        query, cache, meta.seq_lens, meta.block_tables, out, SCALE, lora, splits, block_n
    )
    ref = torch_ref(query, cache, meta, lora)
    dense = mla_attention_dense_ref(query, cache, meta, SCALE, lora)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, dense, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ref, dense, atol=2e-5, rtol=2e-5)


def test_decode_kernel_bf16_within_bf16_rounding() -> None:
    """bfloat16 queries and cache, DeepSeek's real widths (512 + 64) on a few heads: within
    bf16 rounding of the float64 oracle on the same bf16 inputs, and of the reference."""
    shape = [(1, 37), (1, 16), (1, 70)]
    query, cache, meta = latent_batch(shape, 16, 512, 64, torch.bfloat16)
    out = torch.empty(len(shape), 16, 512, dtype=torch.bfloat16, device=query.device)
    mla_decode_attention(query, cache, meta.seq_lens, meta.block_tables, out, SCALE, 512, 2)
    dense = mla_attention_dense_ref(query, cache, meta, SCALE, 512)
    assert_rel_close(out, dense, 2e-2)
    assert_rel_close(out, torch_ref(query, cache, meta, 512), 2e-2)


@pytest.mark.parametrize("case", ["mixed", "decode", "chunked_prefill"])
def test_mla_attention_triton_mixed_step(case: str) -> None:
    """A step's decode rows through the MLA kernel, its prefill rows (fresh, prefix hits,
    chunks) through the generic prefill kernel, padding rows zero: equal to the torch path
    (``mla_attention`` without the interpreter) and the oracle."""
    shape = ATTENTION_CASES[case]
    query, cache, meta = latent_batch(shape, 4, 32, 8, torch.float32, padding_rows=3)
    out = mla_attention_triton(query, cache, meta, SCALE, 32, block_n=16)
    assert out.shape == (query.shape[0], 4, 32)
    assert torch.count_nonzero(out[-3:]) == 0
    real = query.shape[0] - 3
    dense = mla_attention_dense_ref(query, cache, meta, SCALE, 32)
    torch.testing.assert_close(out[:real], dense[:real], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, torch_ref(query, cache, meta, 32), atol=2e-5, rtol=2e-5)


def test_mla_attention_dispatches_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the interpreter on CPU ``mla_attention`` is the torch reference, bit for bit."""
    if ON_CUDA:
        pytest.skip("CPU dispatch")
    query, cache, meta = latent_batch(ATTENTION_CASES["mixed"], 4, 32, 8, torch.float32)
    monkeypatch.delenv("TRITON_INTERPRET")
    torch.testing.assert_close(
        mla_attention(query, cache, meta, SCALE, 32), torch_ref(query, cache, meta, 32),
        atol=0.0, rtol=0.0,
    )  # fmt: skip


def test_decode_kernel_fp8_cache_reads_the_scale() -> None:
    """An fp8 latent cache with a scale: the kernel equals the reference and the oracle on
    the same e4m3 values (the scale folds into the scores and the output)."""
    query, cache, meta = latent_batch(DECODES, 4, 32, 8, torch.float32)
    scale = torch.tensor([cache.abs().max().item() / 448.0], device=query.device)
    fp8 = quantize_fp8(cache, scale)
    out = torch.empty(len(DECODES), 4, 32, device=query.device)
    mla_decode_attention(
        query, fp8, meta.seq_lens, meta.block_tables, out, SCALE, 32, 2, cache_scale=scale
    )
    torch.testing.assert_close(out, torch_ref(query, fp8, meta, 32, scale), atol=1e-4, rtol=1e-4)
    dense = mla_attention_dense_ref(query, fp8, meta, SCALE, 32, scale)
    torch.testing.assert_close(out, dense, atol=1e-4, rtol=1e-4)


def test_head_block_fills_dot_rows_and_caps_the_group() -> None:
    assert [head_block(h) for h in (1, 16, 20, 64, 128)] == [16, 16, 32, 64, 64]


def test_wide_latent_prefill_runs_in_head_chunks() -> None:
    """Past 256 features the prefill rows run 16 query heads per launch (sm_90's shared
    memory): 20 heads (a chunk of 16 and one of 4) of 256 + 16 features, a decode, a prefix
    hit and a fresh prefill: equal to the oracle."""
    shape = [(1, 21), (5, 37), (18, 18)]
    query, cache, meta = latent_batch(shape, 20, 256, 16, torch.float32)
    out = mla_attention_triton(query, cache, meta, SCALE, 256)
    dense = mla_attention_dense_ref(query, cache, meta, SCALE, 256)
    torch.testing.assert_close(out, dense, atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("heads", [16, 128])  # DeepSeek-V2-Lite, V3 (two head groups)
def test_gpu_mla_decode_bf16_long_contexts(heads: int) -> None:
    """Compiled: 48 decodes up to 4k context at 512 + 64 features, a prefix-hit prefill and
    padding rows, bf16, against the float64 oracle on the same inputs."""
    gen = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 4096, (48,), generator=gen).tolist()
    shape = [(1, n) for n in lens] + [(64, 300)]
    query, cache, meta = latent_batch(shape, heads, 512, 64, torch.bfloat16, padding_rows=3)
    out = mla_attention_triton(query, cache, meta, SCALE, 512)
    dense = mla_attention_dense_ref(query, cache, meta, SCALE, 512)
    assert_rel_close(out, dense, 2e-2)
    assert not out[-3:].any()
