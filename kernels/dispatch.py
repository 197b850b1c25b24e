"""Choose between a Triton kernel and its torch reference, per call.

Triton runs for CUDA tensors (when triton is installed), and for CPU tensors only when
``TRITON_INTERPRET=1`` (tests: Triton's CPU interpreter). Everything else takes the torch
reference, so the CPU engine never imports triton and its hot path costs one env lookup.

The ``*_triton`` modules are imported lazily by the dispatching function, never at package
import: ``triton.jit`` decides between compiled and interpreted when the kernel is *defined*,
so the import must happen after ``TRITON_INTERPRET`` is set, and a runtime without triton
must still import.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the Triton kernel should handle ``tensor``'s op."""
    if tensor.is_cuda:
        return triton_available()
    return tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_available() -> bool:
    """Whether triton can be imported (a bare GPU box may lack it; the reference still runs)."""
    return importlib.util.find_spec("triton") is not None


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (>= 1); ``tl.arange`` extents must be powers of two."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
