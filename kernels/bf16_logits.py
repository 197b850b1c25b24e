"""A CPU LM head that streams a bfloat16 copy of the weight, with its top logits recomputed
exactly.

One decode step of SmolLM2-135M (kept quantized) spent about a quarter of its time in the
float32 LM head: 49152 x 576 float32 weights (113 MB) streamed every step
(``scripts/cpu_step_profile.py``). oneDNN's bf16 matmul (AVX-512 bf16) on a weight reordered
once into its blocked layout streams half the bytes and ran 1.8-2x faster at 1 and 16 rows.
Its logits are bf16-rounded (weights and output), so each row's ``refine`` highest logits
are then recomputed in float32 from the float32 weight (a gather of ``refine`` rows and a dot
product each): the token greedy decoding picks, and the top logprobs, come from float32
logits; the rest of the vocabulary keeps the bf16 values (error ~0.1 on logits ~20).

Batch invariance (defects #20) holds as for ``invariant_linear``: the reordered layout runs
one kernel for every row count and the refinement is per row, so a row's logits do not
depend on the other rows (``tests/kernels/test_bf16_logits.py``). Only CPU float32
activations take this path; anything else is ``invariant_linear`` on the float32 weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenwire.kernels.invariant_linear import (
    InvariantLinearWeight,
    invariant_linear,
    prepare_invariant_linear,
)

# Rows per oneDNN call, as in ``invariant_linear``.
_MAX_ROWS = 256
# Top logits per row recomputed in float32: the bf16 logits' error (~0.1) is far below the
# gap from a row's top logit to its 16th.
DEFAULT_REFINE = 16


@dataclass(frozen=True)
class Bf16LogitsWeight:
    """``weight`` [N, K] float32, its bf16 reordered copy ``packed`` (None where oneDNN's bf16
    path is unavailable: then ``fallback`` runs) and the rows to refine per row."""

    weight: torch.Tensor
    packed: torch.Tensor | None
    fallback: InvariantLinearWeight
    refine: int
    version: int = 0

    def is_current(self, weight: torch.Tensor) -> bool:
        """Whether this was prepared from ``weight`` as it is now."""
        return self.fallback.is_current(weight)


def bf16_supported(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can take the bf16 path: a float32 CPU tensor, oneDNN with bf16."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def prepare_bf16_logits(weight: torch.Tensor, refine: int = DEFAULT_REFINE) -> Bf16LogitsWeight:
    """The bf16 reordered copy of ``weight`` (float32 [N, K]) for ``bf16_logits``."""
    weight = weight.detach()
    if not bf16_supported(weight):
        fallback = prepare_invariant_linear(weight)
        return Bf16LogitsWeight(weight, None, fallback, refine, fallback.version)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16).contiguous(), None)
    plain = InvariantLinearWeight(weight, None, _version(weight))
    return Bf16LogitsWeight(weight, packed, plain, min(refine, weight.shape[0]), plain.version)


def bf16_logits(x: torch.Tensor, w: Bf16LogitsWeight) -> torch.Tensor:
    """``x [M, K] @ weight.T -> [M, N]`` float32: bf16 logits, each row's ``refine`` highest
    recomputed in float32."""
    unusable = x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[0] == 0
    if w.packed is None or unusable:
        return invariant_linear(x, w.fallback)
    x = x.contiguous()
    if x.shape[0] <= _MAX_ROWS:
        return _refined(x, w.weight, w.packed, w.refine)
    parts = [_refined(part, w.weight, w.packed, w.refine) for part in x.split(_MAX_ROWS)]
    return torch.cat(parts)


def _refined(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, k: int) -> torch.Tensor:
    xb = x.to(torch.bfloat16)
    out = torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], "")
    return refine_top_logits(out.float(), x, weight, k)


def refine_top_logits(
    logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, k: int
) -> torch.Tensor:
    """``logits`` [M, N] float32 (approximate) with each row's ``k`` highest recomputed in
    float32 from ``weight`` [N, K] and ``x`` [M, K], row by row (in place; returned)."""
    if k > 0:
        top = logits.topk(k, dim=-1, sorted=False).indices  # [M, k]
        rows = weight.index_select(0, top.reshape(-1)).view(x.shape[0], k, x.shape[1])
        exact = (rows * x.unsqueeze(1)).sum(-1)  # each row's dot products, row by row
        logits.scatter_(1, top, exact)
    return logits


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version
