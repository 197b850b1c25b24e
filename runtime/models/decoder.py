"""One decoder layer of the Llama-style model: attention, gated MLP and their norms.

Every family difference comes from ``ModelArch``: GQA, qkv/o biases, q/k norms (Qwen3,
Gemma 3), the norm variant (Gemma's ``1 + w``), Gemma 2/3's sandwich norms (4 per layer),
the attention scale (``query_pre_attn_scalar``), attention logit soft-capping (Gemma 2), the
MLP activation (SwiGLU or GeGLU), each layer's attention window and gpt-oss's attention
sinks (``self_attn.sinks``); Llama 4's chunked local attention, NoPE layers (no rotary;
their queries scaled by the attention temperature) and weightless q/k norm after rotary.

Tokens are flattened (no batch dimension); projections are fused (``qkv_proj``,
``gate_up_proj``) and tensor-parallel (``layers.parallel``): ``o_proj`` and ``down_proj``
all-reduce under TP. The LoRA manager wraps ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and
``down_proj`` by these names.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenwire.kernels.activation import gated_activation
from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.image_attention import image_run_attention
from tokenwire.kernels.kv_quant import LayerKVCache
from tokenwire.kernels.llama4_attention import attn_temperature_scales, weightless_rms_norm
from tokenwire.kernels.paged_attention import paged_attention
from tokenwire.kernels.rotary import apply_rotary
from tokenwire.kernels.store_kv import store_kv
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
)
from tokenwire.runtime.models.layers.basic import make_rms_norm
from tokenwire.runtime.models.layers.quant.base import MethodFor
from tokenwire.runtime.models.mla import MLAttention
from tokenwire.runtime.models.moe import SparseMoeBlock

# A layer's attention as one opaque call, ``(q, k, v, layer index) -> out``: store K/V and
# attend with the step's metadata held by whoever installed it (``worker.cpu_compile``), so a
# compiled forward sees no cache tensors and no Python metadata.
ExternalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]

# One layer's paged KV cache: (k_cache, v_cache), each [num_blocks, block_size, Hkv, D], and
# the (k_scale, v_scale) of an fp8 cache (None otherwise).
KVCache = LayerKVCache


def norm(arch: ModelArch, size: int, dtype: torch.dtype) -> RMSNorm:
    """The family's RMSNorm over ``size`` features."""
    return make_rms_norm(size, arch.rms_norm_eps, dtype, arch.norm_unit_offset)


class Attention(nn.Module):
    """This rank's heads (all of them at TP=1); ``o_proj`` all-reduces under TP."""

    def __init__(
        self,
        arch: ModelArch,
        layer: int,
        dtype: torch.dtype,
        tp: TPGroup,
        methods: MethodFor,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}.self_attn"
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.attention_bias,
            dtype,
            tp,
            methods(f"{prefix}.qkv_proj"),
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.scale = arch.attention_scale
        self.logits_soft_cap = arch.attn_logit_softcap
        self.sliding_window = arch.layer_window(layer)
        # Llama 4: chunked local attention, NoPE layers, q/k L2 norm, attention temperature.
        self.attention_chunk = arch.layer_chunk(layer)
        self.use_rope = arch.layer_uses_rope(layer)
        self.l2_norm_eps = arch.rms_norm_eps if arch.qk_l2_norm and self.use_rope else None
        self.temperature = None if self.use_rope else arch.attn_temperature
        self.o_proj = RowParallelLinear(
            arch.q_size, arch.hidden_size, arch.o_proj_bias, dtype, tp, "attention size",
            methods(f"{prefix}.o_proj"),
        )  # fmt: skip
        # gpt-oss: every head's sink logit (all heads, replicated; this rank reads its own).
        self.sinks: nn.Parameter | None = None
        if arch.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(arch.num_attention_heads, dtype=dtype))
        self.head_start = self.qkv_proj.heads.head_start
        self.layer_index = layer
        # Set by a compiled forward (``worker.cpu_compile``): used when the forward gets no
        # metadata. Not a submodule, not a parameter.
        self.external_attention: ExternalAttention | None = None
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if arch.qk_norm:
            self.q_norm = norm(arch, arch.head_dim, dtype)
            self.k_norm = norm(arch, arch.head_dim, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache | None,
        meta: AttentionMetadata | None,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        """``meta`` None: the step's attention is ``external_attention`` (no cache here)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.position_qk(q, k, positions, cos_sin_cache)
        if meta is None or kv_cache is None:
            if self.external_attention is None:
                raise ValueError("attention needs metadata and a KV cache")
            out = self.external_attention(q, k, v, self.layer_index)
        else:
            out = self.attend(q, k, v, kv_cache, meta)
        result: torch.Tensor = self.o_proj(out.reshape(num_tokens, self.q_size))
        return result

    def position_qk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary (unless a NoPE layer), then Llama 4's q/k L2 norm or temperature."""
        if self.use_rope:
            q, k = apply_rotary(q, k, positions, cos_sin_cache)
        if self.l2_norm_eps is not None:
            q = weightless_rms_norm(q, self.l2_norm_eps)
            k = weightless_rms_norm(k, self.l2_norm_eps)
        if self.temperature is not None:
            scales = attn_temperature_scales(positions, *self.temperature)
            q = (q * scales[:, None, None]).to(q.dtype)
        return q, k

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Store this step's K/V in the paged cache, then attend every row of ``q``."""
        k_cache, v_cache, k_scale, v_scale = kv_cache
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        sinks = None
        if self.sinks is not None:
            sinks = self.sinks[self.head_start : self.head_start + self.num_heads]
        out: torch.Tensor = paged_attention(
            q, k, v, k_cache, v_cache, meta, self.scale, k_scale, v_scale,
            logits_soft_cap=self.logits_soft_cap, sliding_window=self.sliding_window,
            sinks=sinks, attention_chunk=self.attention_chunk,
        )  # fmt: skip
        if meta.image_spans:  # Gemma 3: an image's rows see the whole image
            image_run_attention(
                q, k_cache, v_cache, meta, out, self.scale, k_scale, v_scale,
                self.logits_soft_cap, self.sliding_window,
            )  # fmt: skip
        return out


class MLP(nn.Module):
    """Gated MLP (SwiGLU or GeGLU); the intermediate dimension is split over TP ranks,
    ``down_proj`` all-reduces."""

    def __init__(
        self, arch: ModelArch, layer: int, dtype: torch.dtype, tp: TPGroup, methods: MethodFor
    ) -> None:
        super().__init__()
        inter = arch.intermediate_size
        sizes = {"gate": inter, "up": inter}
        prefix = f"model.layers.{layer}.mlp"
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, sizes, False, dtype, tp, "intermediate_size",
            methods(f"{prefix}.gate_up_proj"),
        )  # fmt: skip
        self.down_proj = RowParallelLinear(
            inter, arch.hidden_size, False, dtype, tp, "intermediate_size",
            methods(f"{prefix}.down_proj"),
        )  # fmt: skip
        self.act_and_mul = gated_activation(arch.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        return result


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with a residual stream; with ``sandwich_norms`` (Gemma)
    the attention and MLP outputs are normed too before they join the residual."""

    def __init__(
        self,
        arch: ModelArch,
        layer: int,
        dtype: torch.dtype,
        tp: TPGroup,
        methods: MethodFor,
    ) -> None:
        super().__init__()
        self.self_attn: Attention | MLAttention = (
            Attention(arch, layer, dtype, tp, methods)
            if arch.mla is None
            else MLAttention(arch, layer, dtype, tp, methods)
        )
        self.mlp: MLP | SparseMoeBlock = (
            SparseMoeBlock(arch, dtype, tp, methods(f"model.layers.{layer}.mlp"))
            if arch.layer_is_sparse(layer)
            else MLP(arch, layer, dtype, tp, methods)
        )
        self.input_layernorm = norm(arch, arch.hidden_size, dtype)
        # Llama: the norm before the MLP. Gemma: the norm of the attention output.
        self.post_attention_layernorm = norm(arch, arch.hidden_size, dtype)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if arch.sandwich_norms:
            self.pre_feedforward_layernorm = norm(arch, arch.hidden_size, dtype)
            self.post_feedforward_layernorm = norm(arch, arch.hidden_size, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache | None,
        meta: AttentionMetadata | None,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream); their sum is the layer's output."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin_cache)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
            return self.mlp(hidden), residual
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual
