"""Build a C++ torch-operator library from ``kernels/csrc/`` once, cache it, load it.

The sources are package data. A library is built with the system C++ compiler (``$CXX``,
else ``c++``) against the installed torch's headers and libraries the first time a process
needs it, and kept under ``$XDG_CACHE_HOME/tokenwire/kernels`` (``~/.cache`` by default;
``TOKENWIRE_KERNEL_CACHE`` overrides it), named by a hash of the sources, the flags, the
compiler's version and torch's version: an edited source, another compiler or another torch
builds anew; a restart loads the cached file (a build takes ~10 s of CPU). The build writes a
temporary file and renames it, so concurrent processes never load a half-written library.
``torch.ops.load_library`` registers the operators its ``TORCH_LIBRARY`` blocks define, so they
are called through torch's dispatcher (eagerly, and as opaque ops inside ``torch.compile``
graphs). OpenMP: the library links ``libgomp.so.1`` by name, which resolves to the copy torch
already loaded: one runtime, one thread pool.

Failure (no compiler, a compile error, a load error) is returned as a reason, never raised:
the caller runs its torch path instead and says why.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

_SOURCES = Path(__file__).parent / "csrc"


@dataclass(frozen=True)
class NativeLibrary:
    """Where the loaded library is (``path``), or why there is none (``reason``)."""

    path: str = ""
    reason: str = ""

    @property
    def loaded(self) -> bool:
        return not self.reason


def cache_dir() -> Path:
    """Where built libraries are kept."""
    override = os.environ.get("TOKENWIRE_KERNEL_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenwire" / "kernels"


def _torch_flags() -> list[str]:
    """Include, link and ABI flags for a library that uses torch's C++ API."""
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib = root / "lib"
    return [
        f"-I{root / 'include'}",
        f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}",
    ]  # fmt: skip


def _compiler_version(cxx: str) -> str:
    done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise OSError(f"{cxx} --version failed: {done.stderr.strip()[:200]}")
    return done.stdout


def build_library(
    source_name: str, includes: tuple[str, ...], flags: tuple[str, ...]
) -> NativeLibrary:
    """Build (or find cached) ``csrc/<source_name>`` (which ``#include``\\ s ``includes``, also
    in ``csrc/``) with ``flags`` and load it into torch."""
    cxx = os.environ.get("CXX", "c++")
    source = _SOURCES / source_name
    command_flags = [*flags, *_torch_flags()]
    try:
        text = b"".join((_SOURCES / name).read_bytes() for name in (source_name, *includes))
        version = _compiler_version(cxx)
    except (OSError, subprocess.SubprocessError) as exc:
        return NativeLibrary(reason=f"no C++ compiler or source: {exc}")
    key_parts = [
        text,
        " ".join(command_flags).encode(),
        version.encode(),
        torch.__version__.encode(),
    ]
    key = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:16]
    folder = cache_dir()
    target = folder / f"{source.stem}-{key}.so"
    if not target.exists():
        reason = _compile([cxx, str(source), *command_flags], folder, target)
        if reason:
            return NativeLibrary(reason=reason)
    try:
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError) as exc:
        return NativeLibrary(reason=f"loading {target} failed: {exc}")
    return NativeLibrary(path=str(target))


def _compile(command: list[str], folder: Path, target: Path) -> str:
    """Compile into a temporary file beside ``target`` and rename it; a failure's reason."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
    except OSError as exc:
        return f"kernel cache {folder} not writable: {exc}"
    full = [*command, "-shared", "-fPIC", "-o", tmp]
    try:
        done = subprocess.run(full, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return f"{' '.join(full[:2])} ... failed: {done.stderr.strip()[-800:]}"
        os.replace(tmp, target)
        return ""
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{' '.join(full[:2])} ... failed: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
