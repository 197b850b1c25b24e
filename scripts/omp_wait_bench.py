#!/usr/bin/env python3
"""The engine core's OpenMP wait policy, served, alternating in one run (issue 42's figure).

Each round starts ``tokenwire serve`` (default model) once per variant: ``default`` (what
tokenwire sets for the core process), ``passive`` (``OMP_WAIT_POLICY=PASSIVE``: OpenMP threads
sleep at once when idle), ``spin10k`` (``GOMP_SPINCOUNT=10000``: a short spin first) and
``spin`` (libgomp's own default, ~300k iterations; a variant that sets a variable also keeps
tokenwire from overriding), then runs ``tokenwire bench serve`` at each concurrency. A run
past ``--timeout`` seconds is reported as such.

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

VARIANTS = {
    "default": {},  # what tokenwire sets (spawn_env.CORE_ENV)
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "spin": {"GOMP_SPINCOUNT": "300000"},  # libgomp's own default
}


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
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["default", "spin"])
    args = p.parse_args()
    figures: dict[tuple[str, int], list[float]] = {}
    base_env = dict(ENV)
    for knob in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        base_env.pop(knob, None)
    for round_ in range(args.rounds):
        for name in args.variants:
            extra = VARIANTS[name]
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
