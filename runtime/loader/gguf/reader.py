"""Read a GGUF file's tensors under HF names, keeping Q4_0/1, Q8_0 and Q4/5/6_K matrices quantized.

``iter_gguf_weights(path)`` yields ``(hf_name, weight)`` per tensor, in file order:

- F32 / F16 / BF16 / F64 tensors: a plain float tensor in the file's dtype;
- Q4_0 / Q4_1 / Q4_K matrices: ``GGUFInt4`` (canonical int4 layout, group 32);
- Q8_0 matrices: ``GGUFInt8`` (canonical int8 layout, group 32); Q6_K: group 16; Q5_K: group
  32 with per-32 minimums (codes 0..31);
- any other quantized type that ``gguf.quants`` can de-quantize (Q2_K, Q3_K, IQ*, ...)
  and Q4/Q8 tensors that are not matrices (stacked experts included: each expert's matrix
  is de-quantized, as tokenwire's experts run float): a float32 tensor, as today's
  conversion does; a type it cannot (Q8_1, Q8_K, integer tensors, ...) is a ``ValueError``
  naming the tensor and the type, as is a block with a non-finite scale.

Llama q/k projections come out in HF's row order (llama.cpp's permutation undone on the raw
rows, before decoding, so every canonical tensor follows it); Phi-3's fused q/k/v and gate/up
tensors and Qwen3-MoE's stacked experts are split on the raw rows too (``parts``), and Gemma's
norm weights have the converter's ``+ 1`` taken off (float32). The GGUF architectures read
are ``families.FAMILIES``; another is a ``ValueError`` naming it. The file is memory-mapped;
each yielded tensor owns its memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch
from gguf import GGMLQuantizationType, quants

from tokenwire.runtime.loader.gguf.blocks import (
    BLOCK,
    Int4Arrays,
    Int8Arrays,
    decode_q4_0,
    decode_q4_1,
    decode_q8_0,
)
from tokenwire.runtime.loader.gguf.blocks_k import (
    Q4_K_GROUP,
    Q5_K_GROUP,
    Q6_K_GROUP,
    decode_q4_k,
    decode_q5_k,
    decode_q6_k,
)
from tokenwire.runtime.loader.gguf.container import open_gguf
from tokenwire.runtime.loader.gguf.names import (
    IGNORED,
    family,
    hf_parts,
    hf_row_order,
    is_norm,
    qk_heads,
)
from tokenwire.runtime.loader.gguf.parts import EXPERT, split_parts
from tokenwire.runtime.loader.gguf.records import GGUFInt4, GGUFInt8

GGUFWeight: TypeAlias = torch.Tensor | GGUFInt4 | GGUFInt8

_FLOAT_TYPES = ("F32", "F16", "F64")
_INT4: dict[str, tuple[Callable[[npt.NDArray[np.uint8]], Int4Arrays], int]] = {
    "Q4_0": (decode_q4_0, BLOCK),
    "Q4_1": (decode_q4_1, BLOCK),
    "Q4_K": (decode_q4_k, Q4_K_GROUP),
}
_INT8: dict[str, tuple[Callable[[npt.NDArray[np.uint8]], Int8Arrays], int]] = {
    "Q8_0": (decode_q8_0, BLOCK),
    "Q6_K": (decode_q6_k, Q6_K_GROUP),
    "Q5_K": (decode_q5_k, Q5_K_GROUP),
}


def iter_gguf_weights(path: Path) -> Iterator[tuple[str, GGUFWeight]]:
    """Yield ``(hf_name, weight)`` for every tensor of the GGUF file at ``path``."""
    gguf = open_gguf(path)
    arch = gguf.metadata.get("general.architecture")
    try:
        fam = family(arch)
    except ValueError as e:
        raise ValueError(f"{path.name}: {e}") from None
    assert isinstance(arch, str)
    counts = _head_counts(gguf.metadata, arch, path) if fam.permuted_qk or fam.fused else None
    for info in gguf.tensors:
        if info.name in IGNORED:
            continue
        names = hf_parts(info.name, arch)
        qtype = info.ggml_type.name
        try:
            data = gguf.tensor_data(info)
            permuted = qk_heads(info.name, *counts) if fam.permuted_qk and counts else None
            if permuted is not None:
                data = data[hf_row_order(data.shape[0], permuted)]
            # Stacked experts are not matrices: de-quantized (tokenwire's experts run float).
            keep = EXPERT not in names[0]
            for name, part in split_parts(names, data, counts):
                weight = _convert(part, info.ggml_type, keep)
                if fam.norm_offset and is_norm(info.name):
                    weight = _unshift(weight, fam.norm_offset)
                yield name, weight
        except ValueError as e:
            raise ValueError(f"GGUF tensor {info.name!r} ({qtype}): {e}") from e


def _head_counts(metadata: Mapping[str, Any], arch: str, path: Path) -> tuple[int, int]:
    """(attention heads, KV heads): to undo a q/k permutation or split a fused q/k/v."""
    heads = metadata.get(f"{arch}.attention.head_count")
    kv_heads = metadata.get(f"{arch}.attention.head_count_kv", heads)
    if not (isinstance(heads, int) and isinstance(kv_heads, int)):
        raise ValueError(f"{path.name}: GGUF metadata lacks scalar {arch}.attention.head_count")
    return heads, kv_heads


def _unshift(weight: GGUFWeight, offset: float) -> torch.Tensor:
    """A norm weight the converter stored as ``offset + w`` (Gemma): ``w`` in float32."""
    if not isinstance(weight, torch.Tensor):
        weight = weight.dequantize()
    return weight.to(torch.float32) - offset


def _convert(
    data: npt.NDArray[Any], ggml_type: GGMLQuantizationType, keep: bool = True
) -> GGUFWeight:
    """One tensor's data (numpy order, raw block bytes for quantized types) -> a weight
    (``keep`` False: never a quantized record)."""
    qtype = ggml_type.name
    if qtype in _FLOAT_TYPES:
        return torch.from_numpy(np.array(data))
    if qtype == "BF16":
        bits = np.ascontiguousarray(data).view("<i2")
        return torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)
    is_matrix = data.ndim == 2 and keep
    t = torch.from_numpy
    if qtype in _INT4 and is_matrix:
        decode4, group = _INT4[qtype]
        a = decode4(data)
        return GGUFInt4(t(a.qweight), t(a.scales), t(a.zeros), group)
    if qtype in _INT8 and is_matrix:
        decode8, group = _INT8[qtype]
        b = decode8(data)
        mins = None if b.mins is None else t(b.mins)
        return GGUFInt8(t(b.qweight), t(b.scales), group, mins)
    return torch.from_numpy(_dequantize(data, ggml_type))


def _dequantize(data: npt.NDArray[Any], ggml_type: GGMLQuantizationType) -> npt.NDArray[np.float32]:
    """Fallback: any quantized type gguf.quants can de-quantize, as float32."""
    qtype = ggml_type.name
    if data.dtype != np.uint8:  # I8 / I16 / I32 / I64: not a weight type
        raise ValueError(f"integer tensor type {qtype} is not supported as a weight")
    try:
        out = quants.dequantize(data, ggml_type)
    except NotImplementedError as e:
        raise ValueError(f"quantization type {qtype} is not supported") from e
    return np.ascontiguousarray(out, dtype=np.float32)
