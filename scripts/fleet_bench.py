"""Issue 28's fleet figure: the ``multiturn`` workload over N tokenwire replicas behind the real
SMG gateway, one routing policy after another, against one replica served directly (the hit
rate a single cache reaches on the same workload). Fresh replicas for every run (no cache
carried from one policy to the next); the prefix-cache hit rate is read from every replica's
/metrics (``tokenwire bench serve --replica-metrics``); TTFT from the client.

    .venv/bin/python scripts/fleet_bench.py [--model PATH] [--replicas 3]
        [--policies round_robin cache_aware consistent_hashing] [--workers http|grpc]
        [--conversations 16] [--turns 4]

``--workers grpc`` needs the replicas' vLLM engine protocol (``--worker-protocol vllm``): the
gateway then tokenizes and routes by token prefixes. ``consistent_hashing`` routes on the
``x-session-id`` header each conversation sends. With gRPC workers, ``cache_aware`` runs over
replicas that record KV events (``--kv-events-config``, in-process hub): SMG subscribes to each
one's ``SubscribeKvEvents`` stream and routes by the blocks it holds; the pseudo-policy
``cache_aware-noevents`` runs the same policy over replicas without them (SMG's approximate
prefix tree), for the figure with and without. Prints one JSON line per run and a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tokenwire.bench.configs import ServeBenchConfig
from tokenwire.bench.fleet_workloads import FleetShape
from tokenwire.bench.serve import serve_bench_summary

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, timeout: float, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited while waiting for {url}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s")


@contextlib.contextmanager
def _group(cmds: list[list[str]], logs: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = []
    try:
        for i, cmd in enumerate(cmds):
            out = open(logs / f"{Path(cmd[0]).name}-{i}.log", "wb")  # noqa: SIM115
            procs.append(
                subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            )
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


NO_EVENTS = "-noevents"  # a policy name's suffix: the same policy, replicas without KV events
KV_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "null"})


def _replica_cmd(
    args: argparse.Namespace, grpc_port: int, rest_port: int, policy: str | None
) -> list[str]:
    cmd = [str(BIN / "tokenwire"), "serve", *([args.model] if args.model else [])]
    cmd += ["--grpc-port", str(grpc_port), "--port", str(rest_port), "--log-format", "json"]
    if args.workers == "grpc":
        cmd += ["--worker-protocol", "vllm"]
        if policy == "cache_aware":  # what SMG's event-driven cache_aware reads
            cmd += ["--kv-events-config", KV_EVENTS]
    return [*cmd, *args.serve_args]


def _run(args: argparse.Namespace, policy: str | None, logs: Path) -> dict[str, Any]:
    """One run: ``policy`` None = one replica, direct; else N replicas behind SMG."""
    n = 1 if policy is None else args.replicas
    ports = [(_free_port(), _free_port()) for _ in range(n)]
    cmds = [_replica_cmd(args, g, r, policy) for g, r in ports]
    with _group(cmds, logs) as replicas:
        for _, rest in ports:
            _wait(f"http://127.0.0.1:{rest}/health", 600, replicas)
        model = httpx.get(f"http://127.0.0.1:{ports[0][1]}/v1/models").json()["data"][0]["id"]
        metrics = tuple(f"http://127.0.0.1:{r}/metrics" for _, r in ports)
        base_url = f"http://127.0.0.1:{ports[0][1]}"
        gateway: list[list[str]] = []
        if policy is not None:
            gw_port = _free_port()
            scheme = "grpc" if args.workers == "grpc" else "http"
            urls = [f"{scheme}://127.0.0.1:{g if scheme == 'grpc' else r}" for g, r in ports]
            gateway = [
                [
                    str(BIN / "smg"),
                    "launch",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(gw_port),
                    "--prometheus-port",
                    str(_free_port()),
                    "--worker-urls",
                    *urls,
                    "--policy",
                    policy.removesuffix(NO_EVENTS),
                    "--routing-key-headers",
                    "x-session-id",
                ]
            ]
            base_url = f"http://127.0.0.1:{gw_port}"
        with _group(gateway, logs) as gw:
            if gw:
                _wait(f"{base_url}/readiness", 120, gw)
            summary = serve_bench_summary(
                ServeBenchConfig(
                    backend="openai",
                    base_url=base_url,
                    model=model,
                    workload=args.workload,
                    text_prompts=True,
                    tokenizer=args.model,
                    concurrency=args.concurrency,
                    replica_metrics=metrics,
                    fleet=FleetShape(conversations=args.conversations, turns=args.turns),
                )
            )
    summary.update({"policy": policy or "single-replica-direct", "replicas": n})
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model for every replica (default: embedded)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument(
        "--policies", nargs="+", default=["round_robin", "cache_aware", "consistent_hashing"]
    )
    p.add_argument("--workers", choices=["http", "grpc"], default="http")
    p.add_argument("--workload", choices=["multiturn", "shared-prefix"], default="multiturn")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--serve-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="extra `tokenwire serve` flags for every replica (last on the line)",
    )
    args = p.parse_args()
    if shutil.which("smg", path=str(BIN)) is None:
        raise SystemExit("smg is not installed in this venv (make dev installs it)")
    logs = Path(os.environ.get("FLEET_BENCH_LOGS", "/tmp/fleet_bench_logs"))
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    for policy in [None, *args.policies]:
        summary = _run(args, policy, logs)
        print(json.dumps(summary), flush=True)
        rows.append(summary)
    single = rows[0]
    print(
        f"\n{'policy':<24}{'hit rate':>10}{'vs single':>11}{'TTFT p50':>10}{'p99 ms':>9}"
        f"{'vs RR p50':>10}{'out tok/s':>11}  prompt tokens per replica"
    )
    rr = next((r for r in rows if r["policy"] == "round_robin"), None)
    for r in rows:
        vs_rr = r["median_ttft_ms"] / rr["median_ttft_ms"] if rr else float("nan")
        print(
            f"{r['policy']:<24}{r['prefix_cache_hit_rate']:>10.3f}"
            f"{r['prefix_cache_hit_rate'] / single['prefix_cache_hit_rate']:>11.2f}"
            f"{r['median_ttft_ms']:>10.1f}{r['p99_ttft_ms']:>9.1f}{vs_rr:>10.2f}"
            f"{r['output_throughput']:>11.1f}  {r['replica_prompt_tokens']}"
        )
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
