"""``tokenwire serve`` as a real subprocess tree for the soak and fault tests: start it in a
session of its own (so its process group lists every process it started), read its ports from
the startup line, scrape ``/metrics``, sum the tree's RSS and wait for the tree to be gone."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from tiny_models import TEST_KV_CACHE_BYTES

SERVING = re.compile(r"serving model=.* grpc=(\S+:\d+) rest=(\S+)")
_SAMPLE = re.compile(r'^(tokenwire:[a-z_]+)\{model_name="[^"]*"\} (\S+)$', re.MULTILINE)


@dataclass
class Served:
    proc: subprocess.Popen[str]
    target: str  # gRPC host:port
    rest_url: str
    lines: list[str]  # every line the server printed so far (a reader thread appends)

    @property
    def core_pid(self) -> int:
        for line in self.lines:
            match = re.search(r'"engine_core_pid": (\d+)', line)
            if match:
                return int(match.group(1))
        raise AssertionError("no engine_core_pid in the startup line")

    def group(self) -> list[int]:
        """Live processes of the server's process group (``ps``), zombies excluded."""
        out = subprocess.run(
            ["ps", "-o", "pid=,stat=", "-g", str(self.proc.pid)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        return [
            int(p) for p, stat in (line.split() for line in out.splitlines()) if "Z" not in stat
        ]

    def tree(self) -> list[psutil.Process]:
        """The server process and every descendant (engine core, resource tracker)."""
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def rss_bytes(self) -> int:
        """Resident memory of the whole tree (the engine core included)."""
        total = 0
        for process in self.tree():
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return total

    def gauges(self) -> dict[str, float]:
        """The ``tokenwire:*`` gauges of ``/metrics`` (model-labelled samples only)."""
        reply = httpx.get(f"{self.rest_url}/metrics", timeout=30)
        reply.raise_for_status()
        return {name: float(value) for name, value in _SAMPLE.findall(reply.text)}

    def kill(self) -> None:
        """SIGKILL the whole group if the server still runs (a failed test's cleanup)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def serve(model: Path, *args: str, env: dict[str, str] | None = None) -> Served:
    """Start ``tokenwire serve MODEL`` on free loopback ports; return once it serves."""
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
    assert exe is not None
    cmd = [exe, "serve", str(model), "--grpc-port", "0", "--port", "0", "--log-format", "json"]
    proc = subprocess.Popen(
        [*cmd, "--max-model-len", "256", "--kv-cache-memory", str(TEST_KV_CACHE_BYTES), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONSAFEPATH="1", **(env or {})),
        start_new_session=True,  # its own process group: ``ps -g`` lists the whole tree
    )
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        match = SERVING.search(line)
        if match:

            def keep_reading() -> None:
                assert proc.stdout is not None
                lines.extend(proc.stdout)

            threading.Thread(target=keep_reading, daemon=True).start()
            return Served(proc, match.group(1), match.group(2), lines)
    raise AssertionError("serve exited before serving:\n" + "".join(lines))


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after ``timeout`` s (psutil waits on each process)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]
