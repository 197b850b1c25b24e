"""llama.cpp's Q/K row permutation in GGUF files and its inverse; random K-quant blocks."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]


K_QUANT_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per 256-element super-block


def llama_cpp_permute(w: Array, heads: int) -> Array:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (HF -> GGUF order)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def unpermute(w: Array, heads: int) -> Array:
    """transformers' reverse permutation (GGUF -> HF order)."""
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def random_k_quant(shape: tuple[int, ...], qtype: Any, rng: np.random.Generator) -> Array:
    """Random Q4_K / Q5_K / Q6_K super-blocks for a [rows, cols] matrix (cols a multiple of
    256), every code and 6-bit / int8 sub-scale random, the fp16 super-block scales small and
    fixed so the weights stay in a small model's range (|w| < 0.2). gguf-py cannot quantize
    K-quants; a reference is ``gguf.quants.dequantize`` of these bytes."""
    from gguf import GGMLQuantizationType as QT

    rows, cols = shape
    size = K_QUANT_BYTES[qtype.name]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    if qtype in (QT.Q4_K, QT.Q5_K):  # fp16 d, fp16 dmin first
        d = 0.0003 if qtype == QT.Q4_K else 0.00015  # Q5_K: codes up to 31
        blocks[..., 0:4] = np.array([d, d], "<f2").view(np.uint8)
    else:  # fp16 d last
        blocks[..., 208:] = np.array([0.0001], "<f2").view(np.uint8)
    return blocks.reshape(rows, -1)
