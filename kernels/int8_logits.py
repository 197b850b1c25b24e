"""A CPU LM head that streams int8 codes (an fp16 scale per 32 weights) through the VNNI
kernel, with each row's top logits recomputed exactly (``--lm-head-dtype int8``).

The default model's tied LM head is its GGUF ``token_embd``, a Q8_0 tensor: int8 codes with
an fp16 scale per 32 values. De-quantized, it is streamed as a bf16 copy today
(``kernels.bf16_logits``, 57 MB per step); the same weights as per-32-block int8 codes are 28
MB plus 1.8 MB of scales, multiplied in integer dot products (``kernels.vnni_matmul``). The
codes are re-derived from the float32 weight (``scale = amax / 127`` rounded to fp16, codes
rounded): for a weight de-quantized from Q8_0 this gives back the file's own codes and scales
exactly (``amax`` is ``127 * scale`` there); any other weight is rounded to int8 (~0.4% of a
block's largest value).

The logits are approximate (int8 activations too, as in ``vnni_matmul``), so each row's
``refine`` highest are then recomputed in float32 from the float32 weight, as ``bf16_logits``
does: the greedy token and the top logprobs come from float32 logits. Batch invariant: the
kernel and the refinement are per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenwire.kernels.bf16_logits import DEFAULT_REFINE, refine_top_logits
from tokenwire.kernels.invariant_linear import (
    InvariantLinearWeight,
    invariant_linear,
    prepare_invariant_linear,
)
from tokenwire.kernels.vnni_matmul import (
    BLOCK,
    VnniWeights,
    pack_int8_vnni,
    vnni_matmul,
    vnni_supported,
)


@dataclass(frozen=True)
class Int8LogitsWeight:
    """``weight`` [N, K] float32, its int8 VNNI copy ``packed`` (None where the kernel cannot
    run: then ``fallback`` runs) and the rows to refine per row."""

    weight: torch.Tensor
    packed: VnniWeights | None
    fallback: InvariantLinearWeight
    refine: int

    def is_current(self, weight: torch.Tensor) -> bool:
        """Whether this was prepared from ``weight`` as it is now."""
        return self.fallback.is_current(weight)


def quantize_int8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[N, K]`` -> (int8 codes ``[N, K]``, fp16-valued scales ``[N, K / 32]``)."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // BLOCK, BLOCK)
    scales = (blocks.abs().amax(-1) / 127).to(torch.float16).float()
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (blocks / safe[..., None]).round().clamp(-128, 127).to(torch.int8)
    return codes.reshape(n, k), scales


def prepare_int8_logits(weight: torch.Tensor, refine: int = DEFAULT_REFINE) -> Int8LogitsWeight:
    """The int8 VNNI copy of ``weight`` (float32 [N, K]) for ``int8_logits``."""
    weight = weight.detach()
    plain = InvariantLinearWeight(weight, None, -1 if weight.is_inference() else weight._version)
    usable = weight.device.type == "cpu" and weight.dtype == torch.float32
    if not usable or not vnni_supported(weight.shape[1], BLOCK):
        return Int8LogitsWeight(weight, None, prepare_invariant_linear(weight), refine)
    codes, scales = quantize_int8_blocks(weight)
    packed = pack_int8_vnni(codes, scales)
    return Int8LogitsWeight(weight, packed, plain, min(refine, weight.shape[0]))


def int8_logits(x: torch.Tensor, w: Int8LogitsWeight) -> torch.Tensor:
    """``x [M, K] @ weight.T -> [M, N]`` float32: int8 logits, each row's ``refine`` highest
    recomputed in float32."""
    unusable = x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[0] == 0
    if w.packed is None or unusable:
        return invariant_linear(x, w.fallback)
    x = x.contiguous()
    return refine_top_logits(vnni_matmul(x, w.packed), x, w.weight, w.refine)
