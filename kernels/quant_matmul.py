"""Weight-only quantized matmuls, the one import point for the layer code.

int4 (``w4a16``) and int8 (``w8a16``) weights in the canonical layouts: ``prepare_*`` once
after loading (repacks for the backend that runs them), ``*_matmul`` per call (the backend
follows the device and dtype: Triton on CUDA, torch's packed CPU kernels for bf16/fp16 on CPU,
an exact float32 path on CPU; see ``w4a16.choose_backend``). ``dequantize_*`` are the float32
references.
"""

from __future__ import annotations

from tokenwire.kernels.w4a16 import (
    Backend,
    W4A16Weights,
    choose_backend,
    dequantize_w4a16,
    pack_int4,
    prepare_w4a16,
    unpack_int4,
    w4a16_matmul,
)
from tokenwire.kernels.w8a16 import W8A16Weights, dequantize_w8a16, prepare_w8a16, w8a16_matmul

__all__ = [
    "Backend",
    "W4A16Weights",
    "W8A16Weights",
    "choose_backend",
    "dequantize_w4a16",
    "dequantize_w8a16",
    "pack_int4",
    "prepare_w4a16",
    "prepare_w8a16",
    "unpack_int4",
    "w4a16_matmul",
    "w8a16_matmul",
]
