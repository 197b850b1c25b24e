"""The real SMG gateway (``smg launch``, the Rust binary of the ``smg`` wheel) on loopback in
front of ``tokenwire serve`` replicas, and an outside view of a replica's idleness (its
``/metrics`` gauges) for tests that cannot reach its engine."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from serve_process import Served

MODEL = "tiny"  # the replicas' --served-model-name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    url: str  # http://127.0.0.1:<port>
    log: Path
    command: list[str]
    metrics_url: str  # the gateway's own Prometheus endpoint, http://127.0.0.1:<port>/metrics

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def smg_command() -> str:
    exe = shutil.which("smg", path=os.path.dirname(sys.executable))
    assert exe is not None, "the smg wheel (dev extra) is not installed"
    return exe


def start_gateway(
    worker_urls: list[str],
    *args: str,
    workers: int | None = None,
    timeout: float = 90.0,
    headers: dict[str, str] | None = None,
) -> Gateway:
    """``smg launch`` on free loopback ports; returns once ``workers`` (default: all) of
    ``worker_urls`` are registered and healthy and the gateway answers a request
    (``headers``: what a client must send it, such as its API key)."""
    port, metrics = free_port(), free_port()
    command = [
        smg_command(),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics),
        "--worker-urls",
        *worker_urls,
        "--log-level",
        "warn",
        "--health-check-interval-secs",
        "1",
        "--health-failure-threshold",
        "1",
        "--shutdown-grace-period-secs",
        "1",
        *args,
    ]
    log = Path(tempfile.mkstemp(prefix="smg-", suffix=".log")[1])
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    gateway = Gateway(
        proc, f"http://127.0.0.1:{port}", log, command, f"http://127.0.0.1:{metrics}/metrics"
    )
    try:
        wait_ready(gateway, len(worker_urls) if workers is None else workers, timeout, headers)
    except BaseException:
        gateway.stop()
        raise
    return gateway


def healthy_workers(gateway: Gateway, headers: dict[str, str] | None = None) -> int:
    reply = httpx.get(f"{gateway.url}/workers", timeout=5, headers=headers)
    reply.raise_for_status()
    body = reply.json()
    listed = body.get("workers", body) if isinstance(body, dict) else body
    return sum(1 for w in listed if w.get("is_healthy", w.get("healthy", False)))


def wait_ready(
    gateway: Gateway, workers: int, timeout: float, headers: dict[str, str] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        assert gateway.proc.poll() is None, "smg exited:\n" + gateway.output()[-4000:]
        try:
            models = httpx.get(f"{gateway.url}/v1/models", timeout=5, headers=headers)
            listed = models.status_code == 200 and any(
                m.get("id") == MODEL for m in models.json().get("data", [])
            )
            if listed and healthy_workers(gateway, headers) >= workers:
                # The gateway answers only once it holds the model's tokenizer (fetched
                # from a gRPC worker with GetTokenizer): one token proves it.
                probe = httpx.post(
                    f"{gateway.url}/v1/completions",
                    json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                    timeout=30,
                    headers=headers,
                )
                if probe.status_code == 200:
                    return
                last = probe.text[:300]
            else:
                last = models.text[:300]
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.25)  # polling a subprocess from outside, bounded by the deadline
    raise AssertionError(f"smg not ready in {timeout}s ({last}):\n{gateway.output()[-4000:]}")


def replica_idle(served: Served, timeout: float = 15.0) -> dict[str, float]:
    """Poll a replica's gauges until nothing runs or waits and every KV block is free
    (bounded); the last gauges, for the caller to assert on."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = served.gauges()
        idle = (
            gauges["tokenwire:num_requests_running"] == 0
            and gauges["tokenwire:num_requests_waiting"] == 0
            and gauges["tokenwire:kv_cache_free_blocks"] == gauges["tokenwire:kv_cache_num_blocks"]
        )
        if idle or time.monotonic() > deadline:
            return gauges
        time.sleep(0.1)  # an outside view of a subprocess: bounded poll
