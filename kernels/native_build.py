"""Build a kernel's C source into a shared library once, cache it, load it with ctypes.

The C sources live in ``kernels/csrc/`` (package data). A library is built with the system C
compiler (``$CC``, else ``cc``) the first time a process needs it and kept under
``$XDG_CACHE_HOME/tokenwire/kernels`` (``~/.cache`` by default; ``TOKENWIRE_KERNEL_CACHE``
overrides it), named by a hash of the source, the flags and the compiler's version: an edited
source or another compiler builds anew, a restart loads the cached file (a build takes about
a second). The build writes a temporary file and renames it, so concurrent processes never
load a half-written library. OpenMP: the library links ``libgomp.so.1`` by name; torch has
loaded its own copy of that soname before any kernel is built, so both share one runtime and
one thread pool.

Failure (no compiler, a compile error, a load error) is returned as a reason, never raised:
the caller runs its torch path instead and says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

_SOURCES = Path(__file__).parent / "csrc"


@dataclass(frozen=True)
class NativeLibrary:
    """A loaded library (``lib``) or why there is none (``reason``)."""

    lib: ctypes.CDLL | None
    reason: str = ""
    path: str = ""


def cache_dir() -> Path:
    """Where built libraries are kept."""
    override = os.environ.get("TOKENWIRE_KERNEL_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenwire" / "kernels"


def _compiler_version(cc: str) -> str:
    done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise OSError(f"{cc} --version failed: {done.stderr.strip()[:200]}")
    return done.stdout


def build_library(source_name: str, flags: tuple[str, ...]) -> NativeLibrary:
    """Build (or find cached) ``csrc/<source_name>`` with ``flags`` and load it."""
    cc = os.environ.get("CC", "cc")
    source = _SOURCES / source_name
    try:
        text = source.read_bytes()
        version = _compiler_version(cc)
    except (OSError, subprocess.SubprocessError) as exc:
        return NativeLibrary(None, f"no C compiler or source: {exc}")
    key = hashlib.sha256(text + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    folder = cache_dir()
    target = folder / f"{source.stem}-{key}.so"
    if not target.exists():
        reason = _compile(cc, source, flags, folder, target)
        if reason:
            return NativeLibrary(None, reason)
    try:
        return NativeLibrary(ctypes.CDLL(str(target)), "", str(target))
    except OSError as exc:
        return NativeLibrary(None, f"loading {target} failed: {exc}")


def _compile(cc: str, source: Path, flags: tuple[str, ...], folder: Path, target: Path) -> str:
    """Compile into a temporary file beside ``target`` and rename it; a failure's reason."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
    except OSError as exc:
        return f"kernel cache {folder} not writable: {exc}"
    command = [cc, *flags, "-shared", "-fPIC", str(source), "-o", tmp]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return f"{' '.join(command)} failed: {done.stderr.strip()[:500]}"
        os.replace(tmp, target)
        return ""
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{' '.join(command)} failed: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
