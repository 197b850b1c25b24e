"""Which loaded models run their decoder stack as one operator (``kernels.fused_layers``), and
that operator's weights gathered from the model's modules.

A model qualifies when every layer is what the operator computes (``fused_stack_reason``):
one rank, float32, plain RMSNorm, a SwiGLU MLP, attention with rotary on every layer and no
window, chunk, sink, soft-cap, q/k norm or temperature, and all four linears of every layer
VNNI weights without bias: int4 (``w4a16`` backend "vnni"), int8 (``w8a16`` backend "vnni",
GGUF Q8_0 / Q6_K) or part by part (``kernels.vnni_parts``: Q4_K_M's q/k/v, Q5_K), mixed
freely across layers as a Q4_K_M file mixes them. LoRA wraps the linears after
loading: ``FusedModel.current`` sees the swap and the model runs its torch layers instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenwire.kernels.activation import silu_and_mul
from tokenwire.kernels.fused_layers import PARTS, FusedStack, linear_tensors
from tokenwire.kernels.vnni_matmul import VnniWeights
from tokenwire.kernels.vnni_parts import VnniParts
from tokenwire.kernels.w4a16 import W4A16Weights
from tokenwire.kernels.w8a16 import W8A16Weights
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.decoder import MLP, Attention, DecoderLayer
from tokenwire.runtime.models.layers.basic import RMSNorm


@dataclass(frozen=True)
class FusedModel:
    """The operator's weights and the linear modules they were taken from."""

    stack: FusedStack
    linears: tuple[nn.Module, ...]  # layer 0's qkv, o, gate_up, down (LoRA swaps all at once)

    def current(self, layers: nn.ModuleList) -> bool:
        """Whether the model still runs the modules the weights came from."""
        first = layers[0]
        assert isinstance(first, DecoderLayer)
        return _linears(first) == self.linears


def _linears(layer: DecoderLayer) -> tuple[nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    assert isinstance(attn, Attention) and isinstance(mlp, MLP)
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _vnni_parts(module: nn.Module) -> tuple[VnniWeights, ...] | None:
    """The module's VNNI weights in output order, or None when it has none (or a bias)."""
    if getattr(module, "bias", None) is not None:
        return None
    held: dict[str, Any] = module.__dict__
    w4, w8, parts = held.get("w4a16"), held.get("w8a16"), held.get("kquant")
    if isinstance(w4, W4A16Weights) and w4.backend == "vnni" and w4.vnni is not None:
        return (w4.vnni,) if w4.perm is None else None
    if isinstance(w8, W8A16Weights) and w8.backend == "vnni" and w8.vnni is not None:
        return (w8.vnni,)
    if isinstance(parts, VnniParts) and parts.dense is None and 0 < len(parts.parts) <= PARTS:
        return parts.parts
    return None


def _layer_reason(layer: nn.Module) -> str | None:
    """Why the operator cannot compute this decoder layer; None: it can."""
    if not isinstance(layer, DecoderLayer) or not isinstance(layer.mlp, MLP):
        return "a mixture-of-experts layer"
    attn = layer.self_attn
    if not isinstance(attn, Attention):
        return "multi-head latent attention"
    plain = (
        attn.q_norm is None and attn.sinks is None and attn.logits_soft_cap is None
        and attn.sliding_window is None and attn.attention_chunk is None and attn.use_rope
        and attn.l2_norm_eps is None and attn.temperature is None
    )  # fmt: skip
    if not plain:
        return "its attention (windows, chunks, sinks, soft-caps or q/k norms)"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if layer.pre_feedforward_layernorm is not None or any(type(n) is not RMSNorm for n in norms):
        return "its norms"
    if layer.mlp.act_and_mul is not silu_and_mul:
        return "its MLP activation"
    if any(_vnni_parts(m) is None for m in _linears(layer)):
        return "linears that are not VNNI weights"
    return None


@dataclass(frozen=True)
class StackParts:
    """What the choice reads of a ``LlamaForCausalLM`` (which builds this; no import back)."""

    arch: ModelArch
    layers: nn.ModuleList
    final_norm: nn.Module
    world_size: int
    rope_dtype: torch.dtype
    local_rope: bool  # some layer rotates with a second table (Gemma 3)


def fused_stack_reason(model: StackParts) -> str | None:
    """Why the model keeps its torch layers; None: it can run ``kernels.fused_layers``."""
    if model.world_size != 1:
        return "tensor parallelism"
    if model.rope_dtype != torch.float32 or model.local_rope:
        return "its dtype or rotary tables"
    if model.arch.head_dim % 16 != 0 or model.arch.intermediate_size % 32 != 0:
        return "its head or MLP size"
    if type(model.final_norm) is not RMSNorm:
        return "its final norm"
    for layer in model.layers:
        reason = _layer_reason(layer)
        if reason is not None:
            return reason
    return None if len(model.layers) else "no layers"


def build_fused_stack(model: StackParts) -> FusedModel:
    """The operator's weights for a model ``fused_stack_reason`` accepts."""
    weights: list[torch.Tensor] = []
    counts: list[int] = []
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for module in _linears(layer):
            parts = _vnni_parts(module)
            assert parts is not None
            weights += linear_tensors(parts)
            counts.append(len(parts))
    assert isinstance(model.final_norm, RMSNorm)
    weights.append(model.final_norm.weight)
    arch, first = model.arch, model.layers[0]
    assert isinstance(first, DecoderLayer)
    attn = first.self_attn
    assert isinstance(attn, Attention)
    stack = FusedStack(
        weights=tuple(w.detach().contiguous() for w in weights),
        parts=tuple(counts),
        heads=attn.num_heads,
        kv_heads=attn.num_kv_heads,
        head_dim=arch.head_dim,
        intermediate=arch.intermediate_size,
        eps=arch.rms_norm_eps,
        scale=attn.scale,
    )
    return FusedModel(stack, _linears(first))
