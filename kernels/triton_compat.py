"""Compatibility shims for the Triton versions tokenwire supports (3.6 to 3.9).

Imported only by the ``*_triton`` kernel modules, so the torch-only runtime never loads it.
"""

from __future__ import annotations

import os
from typing import Any

import triton

_FIXED_IN = (3, 7)  # first release whose interpreter squeezes scalars before int()


def _version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def patch_interpreter_scalar_index() -> None:
    """Let Triton < 3.7's CPU interpreter use runtime scalars as ``range`` bounds.

    The interpreter holds scalars as 1-element numpy arrays and converts them with
    ``int(array)``, which numpy >= 2.4 rejects (triton-lang/triton#9171, fixed in 3.7). Loops
    over context lengths read on device (``range(start, end, BLOCK_N)``) need that conversion.
    This re-registers ``__index__`` with the upstream fix, only while interpreting, only on the
    affected versions; the compiled path is untouched. Idempotent.
    """
    if os.environ.get("TRITON_INTERPRET") != "1" or _version() >= _FIXED_IN:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_tokenwire_patched", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        # The scope restores attributes in reverse order, so this layer unwinds cleanly.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._tokenwire_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
