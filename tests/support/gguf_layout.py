"""llama.cpp's Q/K row permutation in GGUF files, and its inverse."""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

Array = npt.NDArray[Any]


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
