"""Decode GGUF Q4_0 / Q4_1 / Q8_0 block bytes into the canonical int4 / int8 arrays (numpy).

A quantized GGUF matrix of HF shape [N, K] is stored as N rows of K // 32 blocks; each block
holds 32 consecutive input elements of one output row, i.e. exactly one (group, column) cell
of the canonical layouts (group size 32). Little-endian block formats (ggml-common.h):

- Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles; byte i holds element i (low nibble) and
  element i + 16 (high nibble); w = (q - 8) * d.
- Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles as Q4_0; w = q * d + m.
- Q8_0 (34 bytes): fp16 d, 32 int8; w = q * d.

Every function works on whole arrays (no loop per block) and raises ``ValueError`` on a block
whose scale or minimum is not finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

BLOCK = 32  # elements per block for Q4_0, Q4_1 and Q8_0
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True)
class Int4Arrays:
    """Canonical int4 arrays: qweight int32 [K//8, N], scales and zeros float32 [G, N]."""

    qweight: npt.NDArray[np.int32]
    scales: npt.NDArray[np.float32]
    zeros: npt.NDArray[np.float32]


@dataclass(frozen=True)
class Int8Arrays:
    """Canonical int8 arrays: qweight int8 [N, K], scales float32 [N, G]; Q5_K's ``mins``
    float32 [N, K // 32] (``w = q * scale + min``), None for the symmetric types."""

    qweight: npt.NDArray[np.int8]
    scales: npt.NDArray[np.float32]
    mins: npt.NDArray[np.float32] | None = None


def _blocks(raw: npt.NDArray[np.uint8], qtype: str) -> npt.NDArray[np.uint8]:
    """[N, row_bytes] -> [N, G, block_bytes]."""
    size = _BLOCK_BYTES[qtype]
    if raw.ndim != 2 or raw.dtype != np.uint8 or raw.shape[1] % size:
        raise ValueError(f"{qtype} data of shape {raw.shape} is not rows of {size}-byte blocks")
    return raw.reshape(raw.shape[0], raw.shape[1] // size, size)


def fp16_field(blocks: npt.NDArray[np.uint8], start: int, what: str) -> npt.NDArray[np.float32]:
    """The little-endian fp16 at byte ``start`` of every block, as float32 [N, G]."""
    field = np.ascontiguousarray(blocks[..., start : start + 2]).view("<f2")[..., 0]
    out = field.astype(np.float32)
    bad = ~np.isfinite(out)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"non-finite block {what} {out[first]} in {int(bad.sum())} block(s), "
            f"first at row {first[0]}, block {first[1]}"
        )
    return out


def _pack_int4(qs: npt.NDArray[np.uint8]) -> npt.NDArray[np.int32]:
    """GGUF nibble bytes [N, G, 16] -> qweight int32 [K // 8, N] (nibble j = code of 8r + j).

    GGUF byte i holds elements i (low) and i + 16 (high); a canonical little-endian int32
    holds elements 8r .. 8r + 7 in ascending nibbles, i.e. byte b holds elements 2b (low) and
    2b + 1 (high). Repacking works on bytes, never on single codes.
    """
    n = qs.shape[0]
    even, odd = qs[..., 0::2], qs[..., 1::2]  # bytes of elements (2b, 2b + 16), (2b + 1, ...)
    first = (even & np.uint8(0x0F)) | (odd << np.uint8(4))  # elements 0 .. 15 of the block
    second = (even >> np.uint8(4)) | (odd & np.uint8(0xF0))  # elements 16 .. 31
    packed = np.concatenate([first, second], axis=-1).reshape(n, -1)  # [N, K // 2]
    words = packed.view("<i4")  # [N, K // 8]
    return np.ascontiguousarray(words.T).astype(np.int32, copy=False)


def decode_q4_0(raw: npt.NDArray[np.uint8]) -> Int4Arrays:
    """Q4_0 rows [N, K // 32 * 18] -> canonical int4 (zero point 8)."""
    blocks = _blocks(raw, "Q4_0")
    d = fp16_field(blocks, 0, "scale d")
    scales = np.ascontiguousarray(d.T)
    return Int4Arrays(_pack_int4(blocks[..., 2:]), scales, np.full_like(scales, 8.0))


def decode_q4_1(raw: npt.NDArray[np.uint8]) -> Int4Arrays:
    """Q4_1 rows [N, K // 32 * 20] -> canonical int4: scale d, zero -m / d.

    A block with d == 0 is the constant m whatever its codes: it becomes codes 0, scale m,
    zero -1, which the canonical formula ``(0 - (-1)) * m`` reproduces exactly.
    """
    blocks = _blocks(raw, "Q4_1")
    d = fp16_field(blocks, 0, "scale d")
    m = fp16_field(blocks, 2, "minimum m")
    qs = blocks[..., 4:]
    flat = d == 0
    if flat.any():
        qs = np.where(flat[..., None], np.uint8(0), qs)
    with np.errstate(divide="ignore", invalid="ignore"):
        zeros = np.where(flat, np.float32(-1.0), -m / d).astype(np.float32)
    scales = np.where(flat, m, d).astype(np.float32)
    qweight = _pack_int4(qs)
    return Int4Arrays(qweight, np.ascontiguousarray(scales.T), np.ascontiguousarray(zeros.T))


def decode_q8_0(raw: npt.NDArray[np.uint8]) -> Int8Arrays:
    """Q8_0 rows [N, K // 32 * 34] -> canonical int8 (signed codes, scales [N, G])."""
    blocks = _blocks(raw, "Q8_0")
    d = fp16_field(blocks, 0, "scale d")
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(raw.shape[0], -1)
    return Int8Arrays(codes, d)
