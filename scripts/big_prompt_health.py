#!/usr/bin/env python3
"""Health-check latency while oversized prompts are refused (issue 10, defect 1's figure).

Starts ``tokenwire serve`` (default model) as its own process, then from separate processes:
one client sends ``Generate(text=<N MiB of prose>)`` requests back to back, another checks
health over its own channel in a loop. Prints the health latencies seen while the large
requests were in flight, and the large requests' statuses, as a table and one JSON line.

    .venv/bin/python scripts/big_prompt_health.py --mib 15 --requests 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenwire.v1 import generation_pb2, generation_pb2_grpc

EXE = shutil.which("tokenwire", path=os.path.dirname(sys.executable)) or "tokenwire"
PROSE = "The quick brown fox jumps over the lazy dog. "


def big_requests(target: str, mib: float, count: int, out: Queue[Any]) -> None:
    text = PROSE * int(mib * (1 << 20) / len(PROSE))
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        results = []
        for _ in range(count):
            t0 = time.perf_counter()
            try:
                stub.Generate(generation_pb2.GenerateRequest(text=text), timeout=120)
                status = "OK"
            except grpc.RpcError as err:
                status = err.code().name
            results.append((status, time.perf_counter() - t0))
    out.put(results)


def health_loop(
    target: str,
    seconds: float,
    stop: Event,
    out: Queue[list[float]],
) -> None:
    """Health checks back to back: for ``seconds`` alone (the baseline), then until stopped."""
    with grpc.insecure_channel(target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        check(health_pb2.HealthCheckRequest(), timeout=30)
        for phase_ends in (lambda t: t >= seconds, lambda _: stop.is_set()):
            latencies: list[float] = []
            start = time.perf_counter()
            while not phase_ends(time.perf_counter() - start):
                t0 = time.perf_counter()
                check(health_pb2.HealthCheckRequest(), timeout=60)
                latencies.append(time.perf_counter() - t0)
            out.put(latencies)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mib", type=float, default=15.0)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--baseline-seconds", type=float, default=3.0)
    args = p.parse_args()
    server, target = _start_server()
    try:
        baseline, results, latencies = _measure(target, args)
    finally:
        server.terminate()
        server.wait(timeout=60)
    _report(args, baseline, results, latencies)
    return 0


def _start_server() -> tuple[subprocess.Popen[str], str]:
    """``tokenwire serve`` (gRPC only, any free port) and its gRPC address once it serves."""
    server = subprocess.Popen(
        [EXE, "serve", "--grpc-port", "0", "--disable-rest", "--log-format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )  # fmt: skip
    assert server.stdout is not None
    target = None
    for line in server.stdout:
        match = re.search(r"serving model=.* grpc=(\S+:\d+)", line)
        if match:
            target = match.group(1)
            break
    assert target is not None, "serve exited before serving"
    threading.Thread(target=server.stdout.read, daemon=True).start()
    return server, target


def _measure(
    target: str, args: argparse.Namespace
) -> tuple[list[float], list[tuple[str, float]], list[float]]:
    """Health-check latencies alone (the baseline), the large requests' (status, seconds),
    and the health-check latencies while they ran."""
    ctx = multiprocessing.get_context("spawn")
    stop, health_out, big_out = ctx.Event(), ctx.Queue(), ctx.Queue()
    prober = ctx.Process(target=health_loop, args=(target, args.baseline_seconds, stop, health_out))
    prober.start()
    baseline = health_out.get(timeout=120)  # no large request yet
    sender = ctx.Process(target=big_requests, args=(target, args.mib, args.requests, big_out))
    sender.start()
    results = big_out.get(timeout=600)
    stop.set()
    latencies = health_out.get(timeout=60)
    sender.join()
    prober.join()
    return baseline, results, latencies


def _report(
    args: argparse.Namespace,
    baseline: list[float],
    results: list[tuple[str, float]],
    latencies: list[float],
) -> None:
    """The summary lines, then the summary as one JSON line."""
    ms = sorted(1000 * x for x in latencies)
    base_ms = sorted(1000 * x for x in baseline)
    summary = {
        "bench": "big_prompt_health",
        "prompt_mib": args.mib,
        "big_requests": [{"status": s, "seconds": round(t, 3)} for s, t in results],
        "health_checks": len(ms),
        "health_p50_ms": statistics.median(ms),
        "health_p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "health_max_ms": ms[-1],
        "health_over_50ms": sum(1 for x in ms if x > 50),
        "baseline_health_checks": len(base_ms),
        "baseline_p99_ms": base_ms[min(len(base_ms) - 1, int(0.99 * len(base_ms)))],
        "baseline_max_ms": base_ms[-1],
    }
    print(f"{args.requests} x Generate({args.mib} MiB text): {[s for s, _ in results]}")
    print(f"  per request: {', '.join(f'{t:.3f} s' for _, t in results)}")
    print(
        f"{len(ms)} health checks meanwhile: p50 {summary['health_p50_ms']:.1f} ms, "
        f"p99 {summary['health_p99_ms']:.1f} ms, max {summary['health_max_ms']:.1f} ms"
    )
    print(
        f"  {summary['health_over_50ms']} over 50 ms; baseline without large requests "
        f"({len(base_ms)} checks): p99 {summary['baseline_p99_ms']:.1f} ms, "
        f"max {summary['baseline_max_ms']:.1f} ms"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    raise SystemExit(main())
