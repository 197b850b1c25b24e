"""DeepSeek's multi-head latent attention over a paged cache of latents.

Per token the layer computes the latent ``c_kv = kv_a_layernorm(x W_kv_a)[:kv_lora_rank]``
and the shared rope key ``k_pe`` (one head, rotated); the paged cache stores only
``[c_kv, k_pe]`` (``kv_lora_rank + qk_rope_head_dim`` features, one KV head; the layer's K and
V caches are one tensor, ``ModelArch.kv_cache_parts`` = 1).

Attention runs in the absorbed form for every row, prefill and decode alike: with
``kv_b_proj`` = per head ``[W_uk; W_uv]`` (``[nope + v, kv_lora_rank]``), a head's score is
``q_nope . (W_uk c) + q_pe . k_pe = (W_uk^T q_nope) . c + q_pe . k_pe``, so the query
``[W_uk^T q_nope, q_pe]`` attends the cached ``[c, k_pe]`` as an MQA head of
``kv_lora_rank + qk_rope_head_dim`` features (``kernels.mla_attention``, values = keys:
the torch paged reference on CPU; on CUDA a Triton MLA decode kernel for decode rows and the
generic Triton prefill kernel for the rest), and the head's output is ``W_uv`` times the
first ``kv_lora_rank`` features of the result.
Why not the expanded form for prefill: it would need the prefix's latents read back and
expanded into per-head K/V (a second attention path over the paged cache); the absorbed form
is one path that is exact in real arithmetic and reuses the existing paged kernels. Its cost
is more FLOPs per score on long prefills (``kv_lora_rank + rope`` instead of
``nope + rope`` per head).

Parameters keep HF's names: ``q_proj`` (stored as ``q_head_proj``: ``loading.map_name``
fuses any ``q_proj`` into ``qkv_proj``) or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``. Tensor parallelism:
heads split (``q_*``/``kv_b_proj`` rows, ``o_proj`` columns, all-reduced); the latent
projections and the cache are replicated on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.kv_quant import LayerKVCache
from tokenwire.kernels.mla_attention import mla_attention
from tokenwire.kernels.rotary import apply_rotary
from tokenwire.kernels.store_kv import store_kv
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.deepseek_config import MLASpec
from tokenwire.runtime.models.layers import (
    MergedColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
)
from tokenwire.runtime.models.layers.basic import Linear, make_rms_norm
from tokenwire.runtime.models.layers.quant.base import MethodFor

_HEADS = "attention heads"


class MLAttention(nn.Module):
    """This rank's heads of one MLA layer; ``o_proj`` all-reduces under TP."""

    def __init__(
        self, arch: ModelArch, layer: int, dtype: torch.dtype, tp: TPGroup, methods: MethodFor
    ) -> None:
        super().__init__()
        mla = arch.mla
        assert mla is not None, "MLAttention needs an MLA architecture"
        prefix = f"model.layers.{layer}.self_attn"
        self.mla: MLASpec = mla
        heads = arch.num_attention_heads
        self.num_heads = heads // tp.world_size
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        q_out = {"": heads * mla.qk_head_dim}
        self.q_head_proj: MergedColumnParallelLinear | None = None
        self.q_a_proj: Linear | None = None
        self.q_b_proj: MergedColumnParallelLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        if mla.q_lora_rank is None:
            self.q_head_proj = MergedColumnParallelLinear(hidden, q_out, False, dtype, tp, _HEADS)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, False, dtype)
            self.q_a_layernorm = make_rms_norm(mla.q_lora_rank, eps, dtype, False)
            self.q_b_proj = MergedColumnParallelLinear(
                mla.q_lora_rank, q_out, False, dtype, tp, _HEADS
            )
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_dim, False, dtype)
        self.kv_a_layernorm = make_rms_norm(mla.kv_lora_rank, eps, dtype, False)
        kv_out = {"": heads * (mla.qk_nope_head_dim + mla.v_head_dim)}
        self.kv_b_proj = MergedColumnParallelLinear(
            mla.kv_lora_rank, kv_out, False, dtype, tp, _HEADS
        )
        self.o_proj = RowParallelLinear(
            heads * mla.v_head_dim, hidden, False, dtype, tp, _HEADS, methods(f"{prefix}.o_proj")
        )
        self.scale = arch.attention_scale
        self.layer_index = layer
        self.external_attention = None  # the compiled CPU forward is not wired for MLA

    def queries(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, heads, qk_nope + qk_rope] of this rank's heads."""
        q: torch.Tensor
        if self.q_head_proj is not None:
            q = self.q_head_proj(hidden)
        else:
            assert self.q_a_proj is not None and self.q_b_proj is not None
            assert self.q_a_layernorm is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        return q.reshape(hidden.shape[0], self.num_heads, self.mla.qk_head_dim)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: LayerKVCache | None,
        meta: AttentionMetadata | None,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        mla, num_tokens = self.mla, hidden.shape[0]
        if meta is None or kv_cache is None:
            raise ValueError("MLA attention needs metadata and a KV cache")
        nope, lora = mla.qk_nope_head_dim, mla.kv_lora_rank
        q = self.queries(hidden)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        compressed: torch.Tensor = self.kv_a_proj_with_mqa(hidden)
        latent, k_pe = self.kv_a_layernorm(compressed[:, :lora]), compressed[:, lora:]
        q_pe, k_pe = apply_rotary(q_pe, k_pe.reshape(num_tokens, 1, -1), positions, cos_sin_cache)
        weight = self.kv_b_proj.weight
        assert isinstance(weight, torch.Tensor)
        w_kv = weight.view(self.num_heads, -1, lora)
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        query = torch.cat([q_latent, q_pe], dim=-1)
        key = torch.cat([latent.reshape(num_tokens, 1, -1), k_pe], dim=-1)
        out = self.attend(query, key, kv_cache, meta)
        values = torch.einsum("thl,hvl->thv", out, w_uv)
        result: torch.Tensor = self.o_proj(values.reshape(num_tokens, -1))
        return result

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Store the step's latents (K and V caches are one tensor), then attend them:
        [T, heads, kv_lora_rank] (``kernels.mla_attention``: the Triton MLA decode kernel on
        CUDA, the torch reference on CPU)."""
        # One tensor, so one scale (an fp8 cache's K scale) for storing and reading it.
        k_cache, v_cache, k_scale, _ = kv_cache
        store_kv(key, key, k_cache, v_cache, meta.slot_mapping, k_scale, k_scale)
        return mla_attention(query, k_cache, meta, self.scale, self.mla.kv_lora_rank, k_scale)
