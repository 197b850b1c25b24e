"""Integer codes packed into int32 words, as GPTQ and AWQ checkpoints store them.

GPTQ packs ``32 // bits`` codes per int32 along one dimension in natural order: element j
(bits ``j*bits ..``) of word i holds index ``i * per_word + j``. AWQ's GEMM format packs int4
codes along the output dimension in the interleaved order ``AWQ_ORDER``: nibble i of word c
holds column ``8c + AWQ_ORDER[i]``.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Nibble holding column 8c + o of an AWQ word: the inverse permutation of AWQ_ORDER.
AWQ_INVERSE_ORDER = tuple(AWQ_ORDER.index(o) for o in range(8))


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> int32 codes in ``[0, 2**bits)``, ``dim`` expanded ``32 // bits``
    times (natural order)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    view = [1] * (packed.dim() + 1)
    view[dim + 1] = per_word
    codes = (packed.unsqueeze(dim + 1) >> shifts.view(view)) & ((1 << bits) - 1)
    return codes.flatten(dim, dim + 1)


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes ``[K, N]`` -> the canonical ``qweight [K // 8, N]`` (nibble j of row r is
    code row ``8r + j``)."""
    k, n = codes.shape
    if k % 8:
        raise ValueError(f"cannot pack {k} input rows into int4 words (not a multiple of 8)")
    rows = codes.to(torch.int32).reshape(k // 8, 8, n)
    packed = torch.zeros(k // 8, n, dtype=torch.int32, device=codes.device)
    for j in range(8):
        packed |= rows[:, j] << (4 * j)
    return packed


def awq_unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int4 words ``[R, N // 8]`` -> codes ``[R, N]`` in column order."""
    codes = unpack_int32(packed, 4, dim=1)
    n = codes.shape[1]
    index = torch.tensor(AWQ_INVERSE_ORDER, device=packed.device).repeat(n // 8)
    index += torch.arange(0, n, 8, device=packed.device).repeat_interleave(8)
    return codes.index_select(1, index)
