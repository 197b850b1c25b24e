"""Define every Triton kernel under the CPU interpreter, once, before any test module runs.

``triton.jit`` picks interpreted or compiled when a kernel is *defined*, so whichever module
imports a ``*_triton`` kernel module first decides for the whole process: a test module that
imports one without ``TRITON_INTERPRET=1`` set leaves compiled ``JITFunction`` helpers that
the interpreter then cannot call ("Cannot call @triton.jit'd outside of the scope of a
kernel"). The root conftest calls :func:`define_kernels_interpreted` first thing, so the
outcome no longer depends on collection order (which ``pytest-xdist`` and folder moves
change). The switch is restored right after: a process-wide ``TRITON_INTERPRET=1`` would send
every other test's CPU model run through the slow interpreter (the kernel tests set it per
test). With CUDA nothing is done: the kernels compile for the GPU.
"""

from __future__ import annotations

import importlib
import os
import pkgutil

import torch

import tokenwire.kernels as kernels_pkg


def triton_kernel_modules() -> list[str]:
    """Names of every ``tokenwire.kernels`` module that defines Triton kernels."""
    return sorted(
        f"{kernels_pkg.__name__}.{info.name}"
        for info in pkgutil.iter_modules(kernels_pkg.__path__)
        if "_triton" in info.name
    )


def define_kernels_interpreted() -> None:
    if torch.cuda.is_available():
        return
    prior = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in triton_kernel_modules():
            importlib.import_module(name)
    finally:
        if prior is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prior
