"""Process-level tuning for CPU inference.

glibc returns large freed blocks (> 128 KiB by default) to the OS with ``munmap``, so every
step's activations are fresh pages and each first touch page-faults. On the VMs this runs on a
page fault costs ~18 us, which added ~10% to a decode step of SmolLM2. Raising glibc's mmap
and trim thresholds keeps freed memory in the heap for reuse. It is a process-wide allocator
setting (not Python state), applied once by the CPU engine; elsewhere it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Allocations below this come from the heap (reused); mallopt returns 0 if glibc refuses it.
_MMAP_THRESHOLD_BYTES = 1 << 30
_TRIM_THRESHOLD_BYTES = 1 << 31  # keep up to this much freed memory at the heap top


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse; False when not on glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    ok_trim = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    return bool(ok_mmap and ok_trim)
