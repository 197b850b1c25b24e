#!/usr/bin/env python3
"""Async scheduling on vs off, served, alternating in one run (issue 43's figure).

Each round starts ``tokenwire serve`` (default model) with ``--no-async-scheduling`` and with
``--async-scheduling`` and runs ``tokenwire bench serve`` at each concurrency against it;
prints one JSON line per run (output tok/s, TTFT and TPOT p50) and the medians per variant
with the load average.

    .venv/bin/python scripts/async_bench.py --rounds 2 --concurrency 1 16
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

VARIANTS = {"sync": ["--no-async-scheduling"], "async": ["--async-scheduling"]}
KEYS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


def served(target: str, workload: str, concurrency: int) -> dict[str, float]:
    out = subprocess.run(
        [EXE, "bench", "serve", "--target", target, "--workload", workload,
         "--concurrency", str(concurrency)],
        capture_output=True, text=True, env=ENV, check=True,
    ).stdout  # fmt: skip
    result = last_json(out)
    return {key: float(result[key]) for key in KEYS}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--workload", default="cpu")
    args = p.parse_args()
    figures: dict[tuple[str, int, str], list[float]] = {}
    for round_ in range(args.rounds):
        for name, flags in VARIANTS.items():
            proc, target = start_server(flags)
            try:
                for c in args.concurrency:
                    row = served(target, args.workload, c)
                    for key, value in row.items():
                        figures.setdefault((name, c, key), []).append(value)
                    line = {"round": round_, "variant": name, "concurrency": c, **row}
                    print(json.dumps(line), flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=120)
    for (name, c, key), values in sorted(figures.items()):
        median = statistics.median(values)
        print(f"{name:5} concurrency {c:3} {key:17}: median {median:8.1f} {values}")
    print(f"load average: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
