"""A whole Llama-style decoder stack in one operator call on CPU (``csrc/fused_layers.c``,
the operator ``tokenwire_vnni::fused_layers`` in ``csrc/vnni_op.cpp``, built with the VNNI
kernels by ``kernels.vnni_matmul``).

Why: with the VNNI int4 linears (``vnni_matmul``), one decode step of SmolLM2-135M spent more
CPU in the ~20 small torch ops per layer around them (RMSNorm, rotary, the cache write,
attention's gathers and sdpa, SwiGLU, residual adds, and the Python between them: ~10 ms of a
~18 ms step at one thread) than in the linears themselves. llama.cpp runs those parts as plain
loops over float buffers; so does this operator: per layer RMSNorm, the fused qkv linear,
rotary (HF's ``rotate_half`` convention), the paged-cache write, causal attention of every
row over the paged cache, ``o_proj``, the residual add and norm, ``gate_up``, SwiGLU and
``down``, then the final norm, with no dispatcher call or allocation between them.

Scope (``runtime.models.fused_stack`` decides per model): float32 activations and KV cache,
every linear a VNNI int4 weight without bias, plain RMSNorm, SwiGLU, full causal attention
with rotary on every layer (no windows, chunks, sinks, soft-caps or q/k norms), one rank.
Every row (decode or prefill) is a single-token query over its own keys ``[0, position]``,
each reduction in one fixed order: a row's result does not depend on the other rows of the
step, their number or the thread count (batch invariance, as the torch path).

Exactness: not the float32 path (the linears quantize activations, ``vnni_matmul``); the
norms, rotary and attention compute the same float32 math as the torch path in another
order (sums and ``expf`` vs torch's kernels), so a few ulps differ per op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.vnni_matmul import VnniWeights

# Tensors per layer in ``FusedStack.weights``: 2 norms + (weight, scales, mins) of 4 linears.
PER_LAYER = 14


@dataclass(frozen=True)
class FusedStack:
    """The operator's weights: per layer the input and post-attention norm weights, then
    qkv, o, gate_up and down as (weight, scales, mins); the final norm's weight last."""

    weights: tuple[torch.Tensor, ...]
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float

    @property
    def num_layers(self) -> int:
        return (len(self.weights) - 1) // PER_LAYER


def linear_tensors(w: VnniWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int4 linear's three tensors in the operator's order."""
    if w.bits != 4 or w.mins is None:
        raise ValueError("fused layers take int4 VNNI weights only")
    return w.weight, w.scales, w.mins


def fused_layers(
    hidden: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    caches: Sequence[torch.Tensor],
    cos_sin: torch.Tensor,
    stack: FusedStack,
) -> torch.Tensor:
    """Embedded ``hidden`` [T, H] -> the final-normed hidden states [T, H], every layer's
    K/V written to ``caches`` (k, v per layer, [blocks, block_size, Hkv, D] float32)."""
    out: torch.Tensor = torch.ops.tokenwire_vnni.fused_layers.default(
        hidden.contiguous(),
        positions.to(torch.int64).contiguous(),
        meta.slot_mapping[: hidden.shape[0]].to(torch.int64).contiguous(),
        meta.query_start_loc.to(torch.int32).contiguous(),
        meta.block_tables.to(torch.int32).contiguous(),
        cos_sin,
        list(stack.weights),
        list(caches),
        [stack.heads, stack.kv_heads, stack.head_dim, stack.intermediate],
        stack.eps,
        stack.scale,
    )
    return out
