"""The MXFP4 weight format (OCP Microscaling v1.0) of gpt-oss checkpoints, de-quantized exactly.

A row of ``K`` weights is stored as ``K / 32`` blocks of 32 FP4 (E2M1) codes and one shared
E8M0 scale per block. ``*_blocks`` is uint8 ``[..., K / 32, 16]``: two codes per byte, the
element with the even index in the low nibble and the odd one in the high nibble.
``*_scales`` is uint8 ``[..., K / 32]``: the block's exponent with bias 127, so a block
scales by ``2 ** (scale - 127)``; 255 is E8M0's NaN and is refused. An E2M1 code is a sign
bit, two exponent bits and one mantissa bit: ``FP4_E2M1_VALUES`` (codes 8-15 are the negated
0-7; 8 is -0.0). This is the layout transformers' ``integrations/mxfp4.py`` reads
(``convert_moe_packed_tensors``).

Every de-quantized value is ``v * 2 ** (s - 127)`` with ``v`` of at most 2 significant bits
and ``s - 127`` in ``[-127, 127]``: exact in float32 and bfloat16 (same exponent range;
``0.5 * 2 ** -127`` is a subnormal of both), except that ``|v| >= 2`` under scale 254 and
``|v| >= 4`` under 253 reach ``2 ** 128``, past both formats' largest finite value: such a
block is refused (transformers would load infinities). float16 cannot hold the range, so a
model run in float16 rounds tiny and huge blocks when the float32 result is copied into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_SIZE = 32  # values per block (one scale each)
BYTES_PER_BLOCK = BLOCK_SIZE // 2  # two 4-bit codes per byte
E8M0_BIAS = 127
E8M0_NAN = 255
FP4_E2M1_VALUES: tuple[float, ...] = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip


def check_mxfp4_pair(
    blocks_name: str, blocks: torch.Tensor, scales_name: str, scales: torch.Tensor
) -> None:
    """Raise ValueError naming the tensor at fault unless ``blocks`` / ``scales`` are an MXFP4
    pair: both uint8, ``blocks [..., G, 16]`` and ``scales [..., G]`` with equal leading dims."""
    for name, tensor in ((blocks_name, blocks), (scales_name, scales)):
        if tensor.dtype != torch.uint8:
            raise ValueError(f"MXFP4 tensor {name!r} has dtype {tensor.dtype}, expected uint8")
    if blocks.dim() < 2 or blocks.shape[-1] != BYTES_PER_BLOCK:
        raise ValueError(
            f"MXFP4 tensor {blocks_name!r} has shape {tuple(blocks.shape)}: expected "
            f"[..., blocks, {BYTES_PER_BLOCK}] ({BLOCK_SIZE} FP4 codes per block, two per byte)"
        )
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"MXFP4 tensor {scales_name!r} has shape {tuple(scales.shape)}: expected "
            f"{tuple(blocks.shape[:-1])}, one scale per block of {blocks_name!r} "
            f"{tuple(blocks.shape)}"
        )


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """``2 ** (scales - 127)`` as float32, built from the bits (exact, no pow): exponent field
    ``s`` for 1..254, the subnormal ``2 ** -127`` for 0. ``scales``: uint8 without 255."""
    bits = scales.to(torch.int32) << 23
    bits = torch.where(scales == 0, torch.tensor(1 << 22, dtype=torch.int32), bits)
    return bits.view(torch.float32)


def _byte_values() -> torch.Tensor:
    """float32 ``[256, 2]``: the two E2M1 values of a byte, the low nibble's first."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack((lut[byte & 0x0F], lut[byte >> 4]), dim=-1)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, name: str = "MXFP4 weight"
) -> torch.Tensor:
    """``blocks [..., G, 16]`` and ``scales [..., G]`` -> float32 ``[..., G * 32]``, exactly.

    ``name`` (the ``*_blocks`` tensor's checkpoint name) is what errors name: a malformed pair
    (``check_mxfp4_pair``), a NaN scale (255) or a value past float32's range raises
    ValueError."""
    scales_name = name.removesuffix("_blocks") + "_scales"
    check_mxfp4_pair(name, blocks, scales_name, scales)
    if bool((scales == E8M0_NAN).any()):
        raise ValueError(f"MXFP4 tensor {scales_name!r} holds the E8M0 NaN scale 255")
    # One lookup per byte into its (low, high) value pair: twice as fast as one per nibble.
    values = F.embedding(blocks.to(torch.int32), _byte_values()).flatten(-2)  # [..., G, 32]
    values = values * e8m0_to_float32(scales).unsqueeze(-1)
    if bool(values.isinf().any()):
        raise ValueError(
            f"MXFP4 tensor {name!r} has values of 2 ** 128 or more (|code| >= 2 with scale "
            "254, or >= 4 with 253): past the float32 / bfloat16 range"
        )
    return values.flatten(-2)


def mxfp4_linear_ref(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` with ``W [N, K]`` kept as MXFP4 (``blocks [N, K/32, 16]``,
    ``scales [N, K/32]``), computed as a kept-quantized kernel would: each 32-value block's dot
    product with the raw E2M1 values, then times that block's ``2 ** (scale - 127)``, summed
    over blocks. The torch reference for a future GPU path (no serving path calls it yet);
    equal to ``x @ dequantize_mxfp4(blocks, scales).T`` up to the order of the sums."""
    check_mxfp4_pair("blocks", blocks, "scales", scales)
    if blocks.dim() != 3 or x.shape[-1] != blocks.shape[1] * BLOCK_SIZE:
        raise ValueError(
            f"x [..., {x.shape[-1]}] does not match MXFP4 blocks {tuple(blocks.shape)}: "
            f"expected blocks [N, {x.shape[-1] // BLOCK_SIZE}, {BYTES_PER_BLOCK}]"
        )
    codes = F.embedding(blocks.to(torch.int32), _byte_values()).flatten(-2).to(x.dtype)
    partial = torch.einsum("...gk,ngk->...ng", x.reshape(*x.shape[:-1], -1, BLOCK_SIZE), codes)
    out = (partial * e8m0_to_float32(scales).to(x.dtype)).sum(-1)
    return out if bias is None else out + bias
