"""Decode GGUF K-quant super-blocks (256 elements) into the canonical int4 / int8 arrays.

Layouts (little-endian, ggml-common.h ``block_q4_K`` / ``block_q6_K``):

- Q4_K (144 bytes): fp16 ``d``, fp16 ``dmin``, 12 bytes of packed 6-bit scales and mins for
  8 sub-blocks of 32, 128 bytes of nibbles. Sub-block ``j``: ``w = d * sc[j] * q - dmin *
  m[j]``; its codes are the low (even ``j``) or high (odd ``j``) nibbles of bytes
  ``32 * (j // 2) ..``. That is an asymmetric int4 group of 32: scale ``d * sc[j]`` (exact in
  float32) and zero ``dmin * m[j] / (d * sc[j])``; the canonical ``(q - zero) * scale`` is the
  reference's ``d * sc * q - dmin * m`` within a few float32 ulps of the weight's magnitude.
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales,
  fp16 ``d``. Element ``e`` of the super-block: ``w = d * scales[e // 16] * (q - 32)``, a
  symmetric int8 group of 16 (codes -32..31, scale ``d * scales[g]``, exact in float32).

- Q5_K (176 bytes): fp16 ``d``, fp16 ``dmin``, Q4_K's 12 bytes of 6-bit scales and mins,
  32 bytes of high bits, 128 bytes of nibbles. Sub-block ``j`` (of 8): ``w = d * sc[j] * q -
  dmin * m[j]`` with ``q`` (0..31) its Q4_K nibble plus bit ``j`` of high byte ``l`` as bit
  4: int8 codes with scale ``d * sc[j]`` and minimum ``-(dmin * m[j])`` per 32, both exact in
  float32, so ``q * scale + min`` is the reference's ``d * sc * q - dmin * m`` bit for bit.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tokenwire.runtime.loader.gguf.blocks import Int4Arrays, Int8Arrays, fp16_field

SUPER = 256  # elements per K-quant super-block
Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES = 144, 176, 210
Q4_K_GROUP, Q5_K_GROUP, Q6_K_GROUP = 32, 32, 16


def _super_blocks(raw: npt.NDArray[np.uint8], size: int, qtype: str) -> npt.NDArray[np.uint8]:
    if raw.ndim != 2 or raw.dtype != np.uint8 or raw.shape[1] % size:
        raise ValueError(f"{qtype} data of shape {raw.shape} is not rows of {size}-byte blocks")
    return raw.reshape(raw.shape[0], raw.shape[1] // size, size)


def pack_int4_codes(codes: npt.NDArray[np.uint8]) -> npt.NDArray[np.int32]:
    """Codes uint8 [N, K] (0..15) -> canonical qweight int32 [K // 8, N] (nibble j of row r =
    code of input 8r + j)."""
    n = codes.shape[0]
    pairs = codes.reshape(n, -1, 2)
    packed = np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << np.uint8(4)))
    return np.ascontiguousarray(packed.view("<i4").T).astype(np.int32, copy=False)


def _q4_k_scales_mins(packed: npt.NDArray[np.uint8]) -> tuple[npt.NDArray[np.uint8], ...]:
    """12 packed bytes [..., 12] -> (scales, mins) [..., 8], 6 bits each: sub-blocks 0-3
    hold them in the low 6 bits of bytes 0-3 / 4-7; sub-blocks 4-7 in the nibbles of bytes
    8-11 with their top 2 bits in the top bits of bytes 0-3 / 4-7."""
    low6, top2 = np.uint8(0x3F), np.uint8(6)
    first, second, third = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales_hi = (third & np.uint8(0x0F)) | ((first >> top2) << np.uint8(4))
    mins_hi = (third >> np.uint8(4)) | ((second >> top2) << np.uint8(4))
    scales = np.concatenate([first & low6, scales_hi], axis=-1)
    mins = np.concatenate([second & low6, mins_hi], axis=-1)
    return scales, mins


def decode_q4_k(raw: npt.NDArray[np.uint8]) -> Int4Arrays:
    """Q4_K rows [N, K // 256 * 144] -> canonical int4, group 32 (scales / zeros [K // 32, N]).

    A sub-block whose scale ``d * sc`` is 0 is the constant ``-dmin * m``: codes 0, scale
    ``-dmin * m``, zero -1, which ``(0 - (-1)) * scale`` reproduces exactly."""
    blocks = _super_blocks(raw, Q4_K_BYTES, "Q4_K")
    n, supers = blocks.shape[:2]
    d = fp16_field(blocks, 0, "scale d")[..., None]
    dmin = fp16_field(blocks, 2, "minimum dmin")[..., None]
    sc, m = _q4_k_scales_mins(blocks[..., 4:16])
    scale = d * sc.astype(np.float32)  # [N, S, 8]
    offset = dmin * m.astype(np.float32)
    nibbles = blocks[..., 16:].reshape(n, supers, 4, 1, 32)
    codes = (nibbles >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & np.uint8(0x0F)
    codes = codes.reshape(n, supers, 8, 32)
    flat = scale == 0
    if flat.any():
        codes = np.where(flat[..., None], np.uint8(0), codes)
    with np.errstate(divide="ignore", invalid="ignore"):
        zeros = np.where(flat, np.float32(-1.0), offset / scale).astype(np.float32)
    scales = np.where(flat, -offset, scale).astype(np.float32)
    qweight = pack_int4_codes(codes.reshape(n, -1))
    return Int4Arrays(
        qweight,
        np.ascontiguousarray(scales.reshape(n, -1).T),
        np.ascontiguousarray(zeros.reshape(n, -1).T),
    )


def decode_q6_k(raw: npt.NDArray[np.uint8]) -> Int8Arrays:
    """Q6_K rows [N, K // 256 * 210] -> canonical int8, group 16 (scales [N, K // 16])."""
    blocks = _super_blocks(raw, Q6_K_BYTES, "Q6_K")
    n, supers = blocks.shape[:2]
    low = blocks[..., 0:128].reshape(n, supers, 2, 2, 32)  # [half, 32-byte run, byte]
    high = blocks[..., 128:192].reshape(n, supers, 2, 1, 32)  # [half, -, byte]
    scales8 = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8)  # [N, S, 16]
    d = fp16_field(blocks, 208, "scale d")[..., None]
    # In each half of 128: element 32 * p + l (p = 0..3) takes nibble p // 2 of low byte
    # 32 * (p % 2) + l and bits 2p..2p+1 of high byte l.
    nibble = np.array([0, 0, 4, 4], np.uint8).reshape(1, 1, 1, 4, 1)
    run = low[:, :, :, [0, 1, 0, 1], :]  # [N, S, half, p, 32]
    lo = (run >> nibble) & np.uint8(0x0F)
    shift = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    hi = (high >> shift) & np.uint8(0x03)
    codes = (lo | (hi << np.uint8(4))).astype(np.int16) - 32
    qweight = codes.astype(np.int8).reshape(n, -1)
    scales = (d * scales8.astype(np.float32)).reshape(n, -1)
    return Int8Arrays(np.ascontiguousarray(qweight), np.ascontiguousarray(scales))


def decode_q5_k(raw: npt.NDArray[np.uint8]) -> Int8Arrays:
    """Q5_K rows [N, K // 256 * 176] -> int8 codes 0..31 [N, K], scales and mins [N, K // 32]."""
    blocks = _super_blocks(raw, Q5_K_BYTES, "Q5_K")
    n, supers = blocks.shape[:2]
    d = fp16_field(blocks, 0, "scale d")[..., None]
    dmin = fp16_field(blocks, 2, "minimum dmin")[..., None]
    sc, m = _q4_k_scales_mins(blocks[..., 4:16])
    high = blocks[..., 16:48].reshape(n, supers, 1, 32)
    nibbles = blocks[..., 48:].reshape(n, supers, 4, 1, 32)
    low = (nibbles >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & np.uint8(0x0F)
    bit = (high >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & np.uint8(1)
    codes = low.reshape(n, supers, 8, 32) | (bit << np.uint8(4))
    scales = (d * sc.astype(np.float32)).reshape(n, -1)
    mins = -(dmin * m.astype(np.float32)).reshape(n, -1)
    qweight = np.ascontiguousarray(codes.reshape(n, -1).astype(np.int8))
    return Int8Arrays(qweight, np.ascontiguousarray(scales), np.ascontiguousarray(mins))
