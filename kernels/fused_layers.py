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
every linear VNNI int4 or int8 "k" weights without bias (up to two parts side by side:
Q4_K_M's int4 q/k beside its Q6_K v), plain RMSNorm, SwiGLU, full causal attention
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

PARTS = 2  # a linear's weights side by side along its output (Q4_K_M: q/k int4, v int8)
LINEARS = 4  # per layer: qkv, o, gate_up, down


@dataclass(frozen=True)
class FusedStack:
    """The operator's weights: per layer the input and post-attention norm weights, then
    qkv, o, gate_up and down as ``linear_tensors``; the final norm's weight last. ``parts``:
    each linear's part count, layer by layer (``LINEARS`` per layer)."""

    weights: tuple[torch.Tensor, ...]
    parts: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float

    @property
    def num_layers(self) -> int:
        return len(self.parts) // LINEARS

    def layer_start(self, layer: int) -> int:
        """Index in ``weights`` of ``layer``'s input norm (``num_layers``: the final norm)."""
        return 2 * layer + 3 * sum(self.parts[: LINEARS * layer])


def linear_tensors(parts: Sequence[VnniWeights]) -> tuple[torch.Tensor, ...]:
    """A linear's weights in the operator's order: (weight, scales, mins) per part, each int4
    (``pack_int4_vnni``) or int8 "k" (``pack_int8k_vnni``, its mins empty when none), 1 to
    ``PARTS`` parts; every part but the last covers whole tiles of 16 outputs."""
    if not 0 < len(parts) <= PARTS:
        raise ValueError(f"a fused linear takes 1 to {PARTS} parts, got {len(parts)}")
    out: list[torch.Tensor] = []
    for i, w in enumerate(parts):
        int4 = w.bits == 4 and w.mins is not None
        if not int4 and w.mode != 16:
            raise ValueError("fused layers take int4 or int8 (float32 scales) VNNI weights only")
        if i < len(parts) - 1 and w.out_features % 16:
            raise ValueError(f"a part of {w.out_features} outputs is not whole tiles of 16")
        mins = w.mins if w.mins is not None else w.scales[:0]
        out += [w.weight, w.scales, mins]
    return tuple(out)


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
        [stack.heads, stack.kv_heads, stack.head_dim, stack.intermediate, *stack.parts],
        stack.eps,
        stack.scale,
    )
    return out
