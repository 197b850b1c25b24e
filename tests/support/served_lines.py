"""A served process's output lines, read as they come, and starting a tenant-configured server."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from tiny_models import TEST_KV_CACHE_BYTES


def _serve_args(model: Path, *flags: str) -> list[str]:
    return ["serve", str(model), "--grpc-port", "0", "--port", "0", *flags]


class _Lines:
    """The server's stdout, line by line, with a wait for a pattern (no sleeps)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        for line in proc.stdout or ():
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()

    def wait_for(self, pattern: str, after: int = 0, timeout: float = 60.0) -> re.Match[str]:
        found: list[re.Match[str]] = []

        def seen() -> bool:
            found[:] = [m for line in self.lines[after:] if (m := re.search(pattern, line))]
            return bool(found)

        with self.cond:
            assert self.cond.wait_for(seen, timeout), f"no {pattern!r} in:\n{''.join(self.lines)}"
        return found[0]


def _start(model: Path, *flags: str) -> subprocess.Popen[str]:
    """``tokenwire serve`` (engine in process, context 256) with ``flags``, stdout piped."""
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
    assert exe is not None
    cmd = [
        exe,
        *_serve_args(
            model,
            "--engine-in-process",
            "--max-model-len",
            "256",
            "--kv-cache-memory",
            str(TEST_KV_CACHE_BYTES),
            *flags,
        ),
    ]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )  # fmt: skip
