"""Triton MLA decode attention over the paged latent cache (DeepSeek-V2/V3, absorbed form).

The cache holds one "KV head" per token: ``[c_kv, k_pe]`` (``kv_lora_rank + rope`` features,
512 + 64 for DeepSeek). Every query head of a row attends the same latents (MQA), and the
values are the first ``kv_lora_rank`` features of the keys. The generic paged decode kernel
would read the 576-feature rows twice (as K and as V, padded to 1024 lanes) and write 576
output features per head; this kernel reads each latent tile once per head group, splits
the feature axis into the latent part (``BLOCK_L``) and the rope part (``BLOCK_R``), so no
lane is padding at DeepSeek's shapes, and reuses the latent tile as the value tile.

Stage 1, grid ``(num_decodes, cdiv(num_heads, BLOCK_H), num_splits)``: a program owns one
row, ``BLOCK_H`` query heads and one contiguous slice of the context (split-K, flash
decoding, as ``paged_attention_triton_decode``): scores
``q_lat . c + q_pe . k_pe`` accumulate in float32 and ``p @ c`` into a float32
``[BLOCK_H, kv_lora_rank]`` accumulator. Stage 2 is the generic decode kernel's reduce over
the slices, at ``HEAD_DIM = kv_lora_rank``. As there, grids depend on batch and head counts
only (CUDA graphs stay valid for any context lengths), an empty row (``seq_len == 0``, graph
padding) gets zeros, and an fp8 cache's scale is read on device: it folds into the score
scale and multiplies the slice outputs (keys and values are one tensor, so one scale).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.dispatch import next_power_of_2
from tokenwire.kernels.kv_quant import is_fp8, unit_scale
from tokenwire.kernels.paged_attention_triton_common import LOG2_E, store_split_partial
from tokenwire.kernels.paged_attention_triton_decode import (
    _decode_reduce_kernel,
    default_num_splits,
)
from tokenwire.kernels.paged_attention_triton_prefill import prefill_attention

_BLOCK_N = 32  # key positions per tile (a [32, 512] bf16 latent tile is 32 KiB)
_BLOCK_N_FP32 = 16  # float32 tiles are twice the bytes; keeps sm_90's shared memory
_MIN_BLOCK_H = 16  # tl.dot needs >= 16 rows
# Prefill rows: query heads per generic-kernel launch, and its key tile at > 256 features.
PREFILL_HEADS = 16
PREFILL_BLOCK_N = 16


@triton.jit
def _load_q_heads(  # type: ignore[no-untyped-def]
    q_ptr,
    row,
    stride_qt,
    stride_qh,
    NUM_HEADS: tl.constexpr,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """The program's ``BLOCK_H`` query heads of ``row``: ``(q_lat, q_pe, heads, h_mask,
    offs_l, l_mask, offs_r, r_mask)``, the latent and rope parts with their lanes."""
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < NUM_HEADS
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_mask = offs_l < LORA
    r_mask = offs_r < ROPE
    q_row = q_ptr + row * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_l[None, :], mask=h_mask[:, None] & l_mask[None, :], other=0.0)
    q_pe = tl.load(
        q_row + LORA + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0
    )
    if DOT_F32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    return q_lat, q_pe, heads, h_mask, offs_l, l_mask, offs_r, r_mask


@triton.jit
def _walk_latents(  # type: ignore[no-untyped-def]
    q_lat,
    q_pe,
    start,
    end,
    qk_scale,
    cache_ptr,
    table_row,
    offs_l,
    l_mask,
    offs_r,
    r_mask,
    stride_cb,
    stride_cs,
    LORA: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The online softmax over the slice's keys ``[start, end)``, the latent tile doubling as
    the value tile: ``(max, sum, acc)``."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        slot = cache_ptr + block * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        c = tl.load(
            slot[:, None] + offs_l[None, :], mask=pos_mask[:, None] & l_mask[None, :], other=0.0
        ).to(q_lat.dtype)
        pe = tl.load(
            slot[:, None] + LORA + offs_r[None, :],
            mask=pos_mask[:, None] & r_mask[None, :],
            other=0.0,
        ).to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(pe), acc=s, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q_lat.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _mla_decode_split_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [T, H, LORA + ROPE]
    cache_ptr,  # [num_blocks, BLOCK_SIZE, 1, LORA + ROPE]
    block_tables_ptr,
    seq_lens_ptr,
    mid_o_ptr,  # float32 [num_decodes, H, num_splits, LORA], contiguous
    mid_lse_ptr,  # float32 [num_decodes, H, num_splits], contiguous
    scale_ptr,  # float32 [1]: the fp8 cache's scale, read only when FP8
    qk_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    DOT_F32: tl.constexpr,  # 16-bit operands upcast for the dots (interpreter only)
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    if FP8:
        qk_scale = qk_scale * tl.load(scale_ptr)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + row)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    q_lat, q_pe, heads, h_mask, offs_l, l_mask, offs_r, r_mask = _load_q_heads(
        q_ptr, row, stride_qt, stride_qh, NUM_HEADS, LORA, ROPE, BLOCK_H, BLOCK_L, BLOCK_R, DOT_F32
    )
    m_i, l_i, acc = _walk_latents(
        q_lat, q_pe, start, end, qk_scale, cache_ptr, block_tables_ptr + row * stride_bt,
        offs_l, l_mask, offs_r, r_mask, stride_cb, stride_cs,
        LORA, BLOCK_H, BLOCK_L, BLOCK_N, BLOCK_SIZE, DOT_PRECISION,
    )  # fmt: skip
    store_split_partial(
        acc, m_i, l_i, mid_o_ptr, mid_lse_ptr, scale_ptr, row, heads, h_mask, split,
        num_splits, offs_l, l_mask, NUM_HEADS, LORA, FP8,
    )  # fmt: skip


def head_block(num_heads: int) -> int:
    """Query heads per program: all of a rank's heads up to 64 (the latent tile is read once
    per program), at least 16 rows for ``tl.dot``."""
    return max(_MIN_BLOCK_H, min(64, next_power_of_2(num_heads)))


def _split_meta(
    query: torch.Tensor, latent_cache: torch.Tensor, kv_lora_rank: int, block_n: int | None
) -> dict[str, object]:
    """``_mla_decode_split_kernel``'s compile-time arguments and launch options."""
    num_heads, rope = query.shape[1], latent_cache.shape[-1] - kv_lora_rank
    fp32 = query.dtype == torch.float32
    if block_n is None:
        block_n = _BLOCK_N_FP32 if fp32 else _BLOCK_N
    block_h = head_block(num_heads)
    # Triton 3.6's interpreter multiplies 16-bit dot operands wrongly (numpy has no bfloat16);
    # there the 16-bit loads, conversions and stores run as compiled and the dots in float32.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return {
        "NUM_HEADS": num_heads,
        "LORA": kv_lora_rank,
        "ROPE": rope,
        "BLOCK_H": block_h,
        "BLOCK_L": next_power_of_2(kv_lora_rank),
        "BLOCK_R": max(16, next_power_of_2(rope)),
        "BLOCK_N": block_n,
        "BLOCK_SIZE": latent_cache.shape[1],
        "DOT_PRECISION": "ieee" if fp32 or interpreted else None,
        "FP8": is_fp8(latent_cache),
        "DOT_F32": interpreted and not fp32,
        "num_warps": 4 if block_h <= 16 else 8,
        "num_stages": 2,
    }


def mla_decode_attention(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int,
    block_n: int | None = None,
    cache_scale: torch.Tensor | None = None,
) -> None:
    """Absorbed-MLA attention of ``num_rows = seq_lens.shape[0]`` one-token rows.

    ``query`` [>= num_rows, H, kv_lora_rank + rope] (unit last stride), ``latent_cache``
    [num_blocks, block_size, 1, kv_lora_rank + rope] (contiguous; bf16/fp16/fp32 or fp8 with
    ``cache_scale`` float32 [1]); the result, the first ``kv_lora_rank`` features of
    ``softmax(q k^T * scale) k``, lands in ``out[:num_rows]`` ([.., H, >= kv_lora_rank], unit
    last stride). ``num_splits`` must not depend on context lengths (CUDA graphs).
    """
    num_rows, num_heads = seq_lens.shape[0], query.shape[1]
    if latent_cache.shape[2] != 1 or not latent_cache.is_contiguous() or query.stride(2) != 1:
        raise ValueError("MLA decode: one contiguous latent head and a unit query stride")
    device = query.device
    mid_o = torch.empty(
        (num_rows, num_heads, num_splits, kv_lora_rank), dtype=torch.float32, device=device
    )
    mid_lse = torch.empty((num_rows, num_heads, num_splits), dtype=torch.float32, device=device)
    fp8 = is_fp8(latent_cache)
    scale_t = (unit_scale(device) if cache_scale is None else cache_scale) if fp8 else mid_lse
    grid = (num_rows, triton.cdiv(num_heads, head_block(num_heads)), num_splits)
    _mla_decode_split_kernel[grid](
        query, latent_cache, block_tables, seq_lens, mid_o, mid_lse, scale_t,
        scale * LOG2_E,
        query.stride(0), query.stride(1),
        latent_cache.stride(0), latent_cache.stride(1),
        block_tables.stride(0),
        **_split_meta(query, latent_cache, kv_lora_rank, block_n),
    )  # fmt: skip
    _decode_reduce_kernel[(num_rows, num_heads)](
        mid_o, mid_lse, out, num_splits, out.stride(0), out.stride(1),
        NUM_Q_HEADS=num_heads,
        HEAD_DIM=kv_lora_rank,
        BLOCK_D=next_power_of_2(kv_lora_rank),
        BLOCK_S=next_power_of_2(num_splits),
        num_warps=4,
    )  # fmt: skip


def mla_attention_triton(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_lora_rank: int,
    cache_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Every row of ``query`` [T, H, kv_lora_rank + rope] -> [T, H, kv_lora_rank] (a view).

    Decode rows (``[0, num_decodes)``) run ``mla_decode_attention``; the other sequences the
    generic Triton prefill kernel over the same cache (values = keys), as one launch. Padding
    rows come back as zeros.
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    nd, ns = meta.num_decodes, meta.num_seqs
    if nd > 0:
        splits = num_splits or default_num_splits(nd, 1, query.device)
        mla_decode_attention(
            query, latent_cache, meta.seq_lens[:nd], meta.block_tables[:nd], out, scale,
            kv_lora_rank, splits, block_n, cache_scale,
        )  # fmt: skip
    if ns > nd:
        _prefill(query, latent_cache, meta, out, scale, block_n, cache_scale)
    num_real = int(meta.query_start_loc_np[ns])
    if num_real < out.shape[0]:
        out[num_real:].zero_()
    return out[..., :kv_lora_rank]


def _prefill(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor,
    scale: float,
    block_n: int | None,
    cache_scale: torch.Tensor | None,
) -> None:
    """The prefill rows through the generic prefill kernel, ``PREFILL_HEADS`` query heads per
    launch: it packs a KV head's whole query group into each tile's rows, and all heads share
    the one latent head, so DeepSeek-V3's 128 heads at 576 (padded 1024) features in one
    tile would need far more than sm_90's shared memory and registers."""
    nd, ns = meta.num_decodes, meta.num_seqs
    qsl = meta.query_start_loc_np
    wide = latent_cache.shape[-1] > 256
    tile_m, tile_n = (PREFILL_HEADS, block_n or PREFILL_BLOCK_N) if wide else (None, block_n)
    for first in range(0, query.shape[1], PREFILL_HEADS):
        heads = slice(first, first + PREFILL_HEADS)
        prefill_attention(
            query[:, heads], latent_cache, latent_cache, meta.query_start_loc[nd : ns + 1],
            meta.seq_lens[nd:ns], meta.block_tables[nd:ns], out[:, heads], scale,
            int(qsl[ns] - qsl[nd]), tile_m, tile_n, cache_scale, cache_scale,
        )  # fmt: skip
