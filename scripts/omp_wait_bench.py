#!/usr/bin/env python3
"""The engine core's OpenMP wait policy, served, alternating in one run (issue 42's figure).

Each round starts ``tokenwire serve`` (default model) twice: with the new default (the core
process spawned with ``OMP_WAIT_POLICY=PASSIVE``: its OpenMP threads sleep when idle) and with
libgomp's own default (``GOMP_SPINCOUNT=300000``: each thread spins ~300k iterations after a
parallel region; setting it also keeps tokenwire from overriding), then runs ``tokenwire bench
serve`` at each concurrency against it. A run past ``--timeout`` seconds is reported as such.

    .venv/bin/python scripts/omp_wait_bench.py --rounds 1 --concurrency 1 16 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from served_vs_offline import ENV, EXE, last_json, start_server

VARIANTS = {"passive": {}, "spin": {"GOMP_SPINCOUNT": "300000"}}


def served(target: str, workload: str, concurrency: int, timeout: float) -> dict[str, float]:
    try:
        out = subprocess.run(
            [EXE, "bench", "serve", "--target", target, "--workload", workload,
             "--concurrency", str(concurrency)],
            capture_output=True, text=True, env=ENV, check=True,
            timeout=timeout,
        ).stdout  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"output_tok_s": 0.0, "timed_out": 1.0}
    result = last_json(out)
    return {
        "output_tok_s": float(result["output_throughput"]),
        "median_ttft_ms": float(result["median_ttft_ms"]),
        "median_tpot_ms": float(result["median_tpot_ms"]),
        "timed_out": 0.0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--workload", default="cpu")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per bench run")
    args = p.parse_args()
    figures: dict[tuple[str, int], list[float]] = {}
    base_env = dict(ENV)
    for knob in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        base_env.pop(knob, None)
    for round_ in range(args.rounds):
        for name, extra in VARIANTS.items():
            proc, target = start_server(["--kv-cache-memory", str(1 << 30)], {**base_env, **extra})
            try:
                for c in args.concurrency:
                    row = served(target, args.workload, c, args.timeout)
                    figures.setdefault((name, c), []).append(row["output_tok_s"])
                    print(json.dumps({"round": round_, "variant": name, "concurrency": c, **row,
                                      "load": os.getloadavg()[0]}), flush=True)  # fmt: skip
            finally:
                proc.terminate()
                proc.wait(timeout=120)
    for (name, c), values in sorted(figures.items()):
        print(f"{name:8} concurrency {c:3}: median {statistics.median(values):7.1f} tok/s {values}")
    print(f"load average: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
