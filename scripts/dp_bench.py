#!/usr/bin/env python3
"""Data parallel vs one core on this box, served, alternating in one run (issue 43's figure).

Each round starts ``tokenwire serve`` (default model) as ``--data-parallel-size 1`` (one core,
every CPU thread) and as ``--data-parallel-size 2`` (two cores, half the threads each) and
runs ``tokenwire bench serve`` at each concurrency against it; prints one JSON line per run and
the median output tok/s per layout with the load average.

    .venv/bin/python scripts/dp_bench.py --rounds 2 --concurrency 16 64
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

LAYOUTS = {"dp1": ["--data-parallel-size", "1"], "dp2": ["--data-parallel-size", "2"]}


def served(target: str, workload: str, concurrency: int) -> float:
    out = subprocess.run(
        [EXE, "bench", "serve", "--target", target, "--workload", workload,
         "--concurrency", str(concurrency)],
        capture_output=True, text=True, env=ENV, check=True,
    ).stdout  # fmt: skip
    return float(last_json(out)["output_throughput"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--workload", default="cpu")
    p.add_argument("--kv-cache-memory", default=str(1 << 30), help="bytes per core")
    args = p.parse_args()
    figures: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for name, flags in LAYOUTS.items():
            proc, target = start_server([*flags, "--kv-cache-memory", args.kv_cache_memory])
            try:
                for c in args.concurrency:
                    tok_s = served(target, args.workload, c)
                    figures.setdefault((name, c), []).append(tok_s)
                    row = {"round": round_, "layout": name, "concurrency": c, "tok_s": tok_s}
                    print(json.dumps(row), flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=120)
    for (name, c), values in sorted(figures.items()):
        print(f"{name:5} concurrency {c:3}: median {statistics.median(values):7.1f} tok/s {values}")
    print(f"load average: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
