#!/usr/bin/env python3
"""Download the wheels the H200 box lacks for the served benchmark into ``.whl/``.

The runtime (``tokenwire.runtime``/``kernels``/``bench`` offline benchmarks) imports only torch,
numpy, triton, tqdm, tokenizers, transformers and safetensors: all already on the box, so
stages (a)-(c) of ``gpu_check.py`` need no wheels. The server stack does: this walks the
dependency closure of its packages *as installed in this venv* (same versions as tested
here), skips what the box already has (KINDS.md's list; ``BOX_HAS``), and always carries
the few whose box version may be too old for our generated protobuf/gRPC code
(``ALWAYS_CARRY``). Run it with the venv's python, from the repo root:

    .venv/bin/python scripts/fetch_gpu_wheels.py      # -> .whl/*.whl (Python 3.12, x86-64)
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = (
    "grpcio", "grpcio-status", "grpcio-health-checking", "grpcio-reflection", "protobuf",
    "googleapis-common-protos", "structlog", "opentelemetry-api", "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-grpc", "opentelemetry-exporter-otlp-proto-http",
    "opentelemetry-instrumentation-grpc", "fastapi", "uvicorn", "httptools",
    "msgspec", "pyzmq",  # the engine-core process transport
)  # fmt: skip
# On the box already (KINDS.md, 2026-11-17), at versions that satisfy our stack.
BOX_HAS = frozenset(
    ["anyio", "certifi", "charset-normalizer", "click", "h11", "httpcore", "httpx", "idna",
     "jinja2", "markupsafe", "packaging", "prometheus-client", "requests", "urllib3", "wrapt",
     "zipp", "uvloop", "pyyaml"]
)  # fmt: skip
# Generated *_pb2/_grpc code refuses older runtimes; pydantic needs a recent typing-extensions.
ALWAYS_CARRY = frozenset({"grpcio", "protobuf", "typing-extensions"})
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_5_x86_64")  # fmt: skip


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: tuple[str, ...]) -> dict[str, str]:
    """name -> installed version for ``roots`` and their non-extra requirements."""
    seen: dict[str, str] = {}
    todo = [_norm(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional or platform-specific requirement not installed here
        seen[name] = dist.version
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            todo.append(_norm(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0]))
    return seen


def main() -> int:
    wanted = {n: v for n, v in closure(ROOTS).items() if n not in BOX_HAS or n in ALWAYS_CARRY}
    out = REPO / ".whl"
    out.mkdir(exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.12", "--implementation", "cp", "-d", str(out),
        *(arg for p in PLATFORMS for arg in ("--platform", p)),
        *(f"{n}=={v}" for n, v in sorted(wanted.items())),
    ]  # fmt: skip
    print("downloading:", " ".join(f"{n}=={v}" for n, v in sorted(wanted.items())))
    subprocess.run(cmd, check=True)
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(f"{len(list(out.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
