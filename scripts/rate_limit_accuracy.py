#!/usr/bin/env python3
"""Rate-limit accuracy (issue 18 item 2's figure): admitted requests per second vs the rate.

Starts ``tokenwire serve`` (default model unless ``--model``) with an ``--api-key-file`` whose
one tenant has ``requests_per_second: RATE`` (burst ``--burst``), then offers ``--factor`` x
RATE one-token ``Generate`` calls per second, open loop (each call starts on schedule, whether
or not earlier ones finished), for ``--seconds``. Counts OK and RESOURCE_EXHAUSTED replies and
prints admitted/s against the rate, with and without the initial burst, as a table and one
JSON line.

    .venv/bin/python scripts/rate_limit_accuracy.py --rate 10 --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from tokenwire.server.tenants.config import hash_key
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

KEY = "rate-limit-accuracy-key"


def start_server(model: str | None, key_file: Path) -> tuple[subprocess.Popen[str], str]:
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
    assert exe is not None, "run from the venv: make dev"
    cmd = [exe, "serve", *([model] if model else []), "--grpc-port", "0", "--disable-rest"]
    cmd += ["--api-key-file", str(key_file), "--log-format", "console"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"serving model=.* grpc=(\S+):(\d+)", line)
        if match:
            # Keep reading (one log line per request): a full pipe would block the server.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, f"{match.group(1)}:{match.group(2)}"
    raise SystemExit(f"the server exited ({proc.wait()}) before serving")


async def drive(target: str, offered_rps: float, seconds: float) -> tuple[Counter[str], float]:
    """Open-loop load: call i starts at t0 + i / offered_rps."""
    counts: Counter[str] = Counter()
    message = generation_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[1, 2, 3, 4]),
        stopping=common_pb2.StoppingOptions(max_tokens=1, ignore_eos=True),
    )
    metadata = (("authorization", f"Bearer {KEY}"),)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        async def one() -> None:
            try:
                await stub.Generate(message, metadata=metadata, timeout=120)
                counts["OK"] += 1
            except grpc.aio.AioRpcError as err:
                counts[err.code().name] += 1

        total = int(offered_rps * seconds)
        tasks = []
        t0 = time.monotonic()
        for i in range(total):
            delay = t0 + i / offered_rps - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # the load schedule itself, not a synchronisation
            tasks.append(asyncio.create_task(one()))
        elapsed = time.monotonic() - t0
        await asyncio.gather(*tasks)
    return counts, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="served model (default: tokenwire's)")
    parser.add_argument("--rate", type=float, default=10.0, help="requests_per_second")
    parser.add_argument(
        "--burst", type=int, default=None, help="default: the key file's (ceil of the rate)"
    )
    parser.add_argument("--factor", type=float, default=2.0, help="offered load / rate")
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    burst = args.burst if args.burst is not None else max(1, math.ceil(args.rate))
    burst_field = f", burst: {args.burst}" if args.burst is not None else ""
    with tempfile.TemporaryDirectory() as tmp:
        key_file = Path(tmp) / "keys.yaml"
        key_file.write_text(
            "tenants:\n  - name: bench\n"
            f"    keys: ['{hash_key(KEY)}']\n"
            f"    limits: {{requests_per_second: {args.rate}{burst_field}}}\n"
        )
        proc, target = start_server(args.model, key_file)
        try:
            counts, elapsed = asyncio.run(drive(target, args.rate * args.factor, args.seconds))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    admitted = counts["OK"] / elapsed
    steady = (counts["OK"] - burst) / elapsed  # the burst is allowed on top of the rate
    result = {
        "configured_rps": args.rate,
        "burst": burst,
        "offered_rps": round(sum(counts.values()) / elapsed, 3),
        "seconds": round(elapsed, 2),
        "statuses": dict(counts),
        "admitted_rps": round(admitted, 3),
        "admitted_rps_without_burst": round(steady, 3),
        "error_pct": round(100 * (admitted - args.rate) / args.rate, 2),
    }
    print(f"{'configured rps':>28} {args.rate:>10.3f}")
    for name in ("offered_rps", "admitted_rps", "admitted_rps_without_burst", "error_pct"):
        print(f"{name:>28} {result[name]:>10}")
    print(f"{'statuses':>28} {dict(counts)}")
    print(json.dumps(result))
    return 0 if abs(result["error_pct"]) <= 5.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
