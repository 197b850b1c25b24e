"""``kernels.fused_layers``: a Llama-style decoder stack of VNNI int4 / int8 linears in one call.

Two stacks: every linear int4 (the default Q4_1 model), and Q4_K_M-like mixed linears (q/k
int4 beside a Q6_K-like int8 v in one qkv linear, Q5_K-like int8 gate/up with minimums, Q6_K
down; ``pack_int8k_vnni``).

Against the same stack run with torch ops (the same VNNI linears; RMSNorm, rotary, the cache
write, the dense attention oracle and SwiGLU from ``kernels``) on a step mixing decodes, a
fresh prefill, a prefix hit and padding rows: outputs and the written caches agree within a
stated bound. A row's bits do not depend on the other rows of the step or the thread count.
Bad positions are refused, not read out of bounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from kernel_inputs import build_metadata, new_cache, scatter_blocks

from tokenwire.kernels.activation import silu_and_mul_ref
from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.fused_layers import FusedStack, fused_layers, linear_tensors
from tokenwire.kernels.paged_attention import paged_attention_dense_ref
from tokenwire.kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref
from tokenwire.kernels.rotary import apply_rotary_ref, build_cos_sin_cache, compute_inv_freq
from tokenwire.kernels.store_kv import store_kv_ref
from tokenwire.kernels.vnni_matmul import (
    VnniWeights,
    pack_int4_vnni,
    pack_int8k_vnni,
    vnni_matmul,
    vnni_status,
)

pytestmark = pytest.mark.skipif(
    not vnni_status().loaded, reason=f"no VNNI kernel here: {vnni_status().reason}"
)
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 128, 256, 4, 2, 32, 3, 16
# |error| / max|reference| of the final hidden states and the caches; measured 5e-5: the
# linears are the same kernel on both sides, the rest float32 in another order, and an
# activation a few ulps off may round to another int8 code in the next linear.
BOUND = 5e-4


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _linear(n: int, k: int, g: torch.Generator) -> VnniWeights:
    scales = (torch.rand(n, k // 32, generator=g) * 0.02 / math.sqrt(k / 128) + 1e-3).half()
    mins = (-8 * scales.float() + torch.randn(n, k // 32, generator=g) * 1e-3).half()
    codes = torch.randint(0, 16, (n, k), generator=g)
    return pack_int4_vnni(codes, scales.float(), mins.float())


def _linear8(n: int, k: int, g: torch.Generator, with_mins: bool) -> VnniWeights:
    """Q6_K-like (codes -32..31, float32 scales per 16) or Q5_K-like (codes 0..31, scale and
    minimum per 32) int8 weights of about ``_linear``'s magnitude."""
    low, high, group = (0, 32, 32) if with_mins else (-32, 32, 16)
    codes = torch.randint(low, high, (n, k), generator=g).to(torch.int8)
    scales = torch.rand(n, k // group, generator=g) * 0.01 / math.sqrt(k / 128) + 5e-4
    mins = -16 * scales if with_mins else None
    return pack_int8k_vnni(codes, scales, mins)


Linear = list[VnniWeights]  # one fused linear's parts, side by side along its output


def _layer(g: torch.Generator, mixed: bool) -> list[Linear]:
    q_kv, kv = (HEADS + KV_HEADS) * HEAD_DIM, KV_HEADS * HEAD_DIM
    if not mixed:
        qkv_out = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        return [[_linear(qkv_out, HIDDEN, g)], [_linear(HIDDEN, HEADS * HEAD_DIM, g)],
                [_linear(2 * INTER, HIDDEN, g)], [_linear(HIDDEN, INTER, g)]]  # fmt: skip
    return [
        [_linear(q_kv, HIDDEN, g), _linear8(kv, HIDDEN, g, with_mins=False)],
        [_linear(HIDDEN, HEADS * HEAD_DIM, g)],
        [_linear8(2 * INTER, HIDDEN, g, with_mins=True)],
        [_linear8(HIDDEN, INTER, g, with_mins=False)],
    ]


def _stack(seed: int = 0, mixed: bool = False) -> tuple[FusedStack, list[list[Linear]]]:
    g = torch.Generator().manual_seed(seed)
    weights: list[torch.Tensor] = []
    linears: list[list[Linear]] = []
    for _ in range(LAYERS):
        norms = [1 + 0.1 * torch.randn(HIDDEN, generator=g) for _ in range(2)]
        layer = _layer(g, mixed)
        weights += norms
        for parts in layer:
            weights += linear_tensors(parts)
        linears.append(layer)
    weights.append(1 + 0.1 * torch.randn(HIDDEN, generator=g))
    counts = tuple(len(parts) for layer in linears for parts in layer)
    stack = FusedStack(
        tuple(weights), counts, HEADS, KV_HEADS, HEAD_DIM, INTER, 1e-5, HEAD_DIM**-0.5
    )
    return stack, linears


def _matmul(x: torch.Tensor, parts: Linear) -> torch.Tensor:
    return torch.cat([vnni_matmul(x, w) for w in parts], dim=-1)


def _cos_sin() -> torch.Tensor:
    return build_cos_sin_cache(compute_inv_freq(HEAD_DIM, 10000.0, None), 512, torch.float32, 1.0)


def _positions(meta: AttentionMetadata) -> torch.Tensor:
    rows: list[int] = []
    qsl, lens = meta.query_start_loc_np, meta.seq_lens_np
    for i in range(meta.num_seqs):
        q = int(qsl[i + 1] - qsl[i])
        rows += range(int(lens[i]) - q, int(lens[i]))
    rows += [0] * (meta.num_tokens - len(rows))
    return torch.tensor(rows, dtype=torch.int64)


def _reference(
    hidden: torch.Tensor,
    meta: AttentionMetadata,
    caches: list[torch.Tensor],
    stack: FusedStack,
    linears: list[list[Linear]],
) -> torch.Tensor:
    """The same stack with torch ops, layer by layer (``runtime.models.decoder``'s order)."""
    positions, cos_sin, t = _positions(meta), _cos_sin(), hidden.shape[0]
    w, residual, h = stack.weights, hidden, hidden
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i, (qkv_w, o_w, gu_w, down_w) in enumerate(linears):
        in_norm, post_norm = w[stack.layer_start(i)], w[stack.layer_start(i) + 1]
        if i == 0:
            x = rms_norm_ref(hidden, in_norm, stack.eps)
        else:
            x, residual = fused_add_rms_norm_ref(h, residual, in_norm, stack.eps)
        q, k, v = _matmul(x, qkv_w).split([q_size, kv_size, kv_size], dim=-1)
        q, k = apply_rotary_ref(
            q.reshape(t, HEADS, HEAD_DIM), k.reshape(t, KV_HEADS, HEAD_DIM), positions, cos_sin
        )
        v = v.reshape(t, KV_HEADS, HEAD_DIM)
        store_kv_ref(k, v, caches[2 * i], caches[2 * i + 1], meta.slot_mapping)
        attn = paged_attention_dense_ref(q, caches[2 * i], caches[2 * i + 1], meta, stack.scale)
        x, residual = fused_add_rms_norm_ref(
            _matmul(attn.reshape(t, q_size), o_w), residual, post_norm, stack.eps
        )
        h = _matmul(silu_and_mul_ref(_matmul(x, gu_w)), down_w)
    out, _ = fused_add_rms_norm_ref(h, residual, w[-1], stack.eps)
    return out


def _inputs(
    shape: list[tuple[int, int]], padding: int = 0, seed: int = 3
) -> tuple[torch.Tensor, AttentionMetadata, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    seqs, num_blocks = scatter_blocks(shape, BLOCK, g)
    meta = build_metadata(seqs, BLOCK, num_padding_rows=padding)
    caches: list[torch.Tensor] = []
    for _ in range(LAYERS):
        caches += new_cache(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, g)
    hidden = torch.randn(meta.num_tokens, HIDDEN, generator=g)
    return hidden, meta, caches


def _run(
    hidden: torch.Tensor, meta: AttentionMetadata, caches: list[torch.Tensor], stack: FusedStack
) -> torch.Tensor:
    return fused_layers(hidden, _positions(meta), meta, caches, _cos_sin(), stack)


MIXED = [(1, 37), (1, 5), (1, 129), (20, 20), (5, 37), (16, 48), (3, 3)]


@pytest.mark.parametrize("mixed", [False, True])
def test_matches_the_stack_run_with_torch_ops(mixed: bool) -> None:
    stack, linears = _stack(mixed=mixed)
    hidden, meta, caches = _inputs(MIXED, padding=2)
    expected_caches = [c.clone() for c in caches]
    expected = _reference(hidden, meta, expected_caches, stack, linears)
    got = _run(hidden, meta, caches, stack)
    real = int(meta.query_start_loc_np[-1])
    scale = expected[:real].abs().max()
    assert ((got[:real] - expected[:real]).abs().max() / scale) < BOUND
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))  # padding rows: zeros
    for mine, theirs in zip(caches, expected_caches, strict=True):
        assert ((mine - theirs).abs().max() / theirs.abs().max()) < BOUND


@pytest.mark.parametrize("mixed", [False, True])
def test_a_row_does_not_depend_on_the_batch_or_the_threads(threads: None, mixed: bool) -> None:
    stack, _ = _stack(mixed=mixed)
    hidden, meta, caches = _inputs(MIXED)
    torch.set_num_threads(2)
    batched = _run(hidden, meta, [c.clone() for c in caches], stack)
    torch.set_num_threads(1)
    assert torch.equal(_run(hidden, meta, [c.clone() for c in caches], stack), batched)
    # Sequence 4 (prefix hit: 5 rows over 37 positions) alone, same blocks and cache.
    start, end = int(meta.query_start_loc_np[4]), int(meta.query_start_loc_np[5])
    g = torch.Generator().manual_seed(3)
    seqs, _ = scatter_blocks(MIXED, BLOCK, g)
    alone_meta = build_metadata([seqs[4]], BLOCK)
    alone = _run(hidden[start:end], alone_meta, [c.clone() for c in caches], stack)
    assert torch.equal(alone, batched[start:end])


def test_positions_past_the_block_table_are_refused() -> None:
    stack, _ = _stack()
    hidden, meta, caches = _inputs([(1, 5)])
    far = torch.tensor([10_000], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="positions past the block tables"):
        fused_layers(hidden, far, meta, caches, _cos_sin(), stack)
