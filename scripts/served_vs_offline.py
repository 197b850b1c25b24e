#!/usr/bin/env python3
"""Served vs offline throughput, alternating in one run (issue 11's figure).

Each round runs the offline engine (``tokenwire bench throughput``) and then, for each engine
placement (the core in its own process, the default; and ``--engine-in-process``), starts
``tokenwire serve`` with the default model and runs ``tokenwire bench serve`` at each
concurrency, reading the front (server) process's CPU seconds around every served run.

    .venv/bin/python scripts/served_vs_offline.py --rounds 3 --concurrency 16 64
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
from typing import Any

import psutil

EXE = shutil.which("tokenwire", path=os.path.dirname(sys.executable)) or "tokenwire"
ENV = dict(os.environ, PYTHONSAFEPATH="1")
MODES = {"process": [], "in-process": ["--engine-in-process"]}


def last_json(output: str) -> dict[str, Any]:
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise RuntimeError("no JSON line in:\n" + output[-2000:])


def offline(workload: str) -> float:
    out = subprocess.run(
        [EXE, "bench", "throughput", "--workload", workload],
        capture_output=True, text=True, env=ENV, check=True,
    ).stdout  # fmt: skip
    return float(last_json(out)["tokenwire_output_tok_s"])


def start_server(
    extra: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [EXE, "serve", "--grpc-port", "0", "--disable-rest", "--log-format", "json", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or ENV,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"grpc=(\S+:\d+)", line)
        if match and "serving model" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, match.group(1)
    raise RuntimeError("serve exited before serving")


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # ended children (the load client)
    return usage.ru_utime + usage.ru_stime


def served(target: str, front_pid: int, workload: str, concurrency: int) -> dict[str, float]:
    before, client_before = cpu_seconds(front_pid), children_cpu_seconds()
    out = subprocess.run(
        [EXE, "bench", "serve", "--target", target, "--workload", workload,
         "--concurrency", str(concurrency)],
        capture_output=True, text=True, env=ENV, check=True,
    ).stdout  # fmt: skip
    front_cpu = cpu_seconds(front_pid) - before
    client_cpu = children_cpu_seconds() - client_before
    result = last_json(out)
    completed = int(result["completed"])
    return {
        "output_tok_s": float(result["output_throughput"]),
        "median_ttft_ms": float(result["median_ttft_ms"]),
        "median_tpot_ms": float(result["median_tpot_ms"]),
        "front_cpu_s_per_100_requests": 100.0 * front_cpu / max(completed, 1),
        # The load generator shares this box's cores with the engine (offline has none).
        "client_cpu_s_per_100_requests": 100.0 * client_cpu / max(completed, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workload", default="cpu")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    for round_no in range(1, args.rounds + 1):
        base = offline(args.workload)
        rows.append({"round": round_no, "target": "offline", "output_tok_s": base})
        print(f"round {round_no}: offline {base:.1f} tok/s", flush=True)
        for mode in args.modes:
            proc, target = start_server(MODES[mode])
            try:
                for c in args.concurrency:
                    r = served(target, proc.pid, args.workload, c)
                    r.update(round=round_no, target=mode, concurrency=c, offline=base)
                    rows.append(r)
                    print(
                        f"round {round_no}: {mode:<10} c={c:<3} {r['output_tok_s']:.1f} tok/s "
                        f"({100 * r['output_tok_s'] / base:.0f}% of offline), front CPU "
                        f"{r['front_cpu_s_per_100_requests']:.1f} s, load client CPU "
                        f"{r['client_cpu_s_per_100_requests']:.1f} s / 100 requests",
                        flush=True,
                    )
            finally:
                proc.terminate()
                proc.wait(timeout=120)
    print_summary(rows, args.modes, args.concurrency)
    print(json.dumps({"bench": "served_vs_offline", "rows": rows}))
    return 0


def print_summary(rows: list[dict[str, Any]], modes: list[str], concurrency: list[int]) -> None:
    offline_mean = statistics.mean(r["output_tok_s"] for r in rows if r["target"] == "offline")
    print(f"\noffline mean {offline_mean:.1f} tok/s")
    for mode in modes:
        for c in concurrency:
            sel = [r for r in rows if r["target"] == mode and r.get("concurrency") == c]
            tok = statistics.mean(r["output_tok_s"] for r in sel)
            ratio = statistics.mean(r["output_tok_s"] / r["offline"] for r in sel)
            cpu = statistics.mean(r["front_cpu_s_per_100_requests"] for r in sel)
            print(
                f"{mode:<10} c={c:<3} mean {tok:.1f} tok/s = {100 * ratio:.0f}% of offline "
                f"(per-round ratio), front CPU {cpu:.1f} s / 100 requests"
            )


if __name__ == "__main__":
    raise SystemExit(main())
