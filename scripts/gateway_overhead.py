"""Gateway overhead: output throughput through the SMG gateway vs straight to the replica.

One ``tokenwire serve`` replica (``--worker-protocol vllm``) and one ``smg launch`` per worker
transport in front of it: ``grpc`` (the vLLM engine protocol: the gateway tokenizes, renders
and detokenizes) and ``http`` (tokenwire's OpenAI REST shim, proxied). The same greedy
completion requests (fixed prompts, ``ignore_eos``, fixed ``max_tokens``) run at
``--concurrency`` through the real OpenAI SDK against: the replica's REST port (``direct``),
``smg-grpc`` and ``smg-http``, interleaved round by round in one run (the order rotating).
Prints a table of output tokens/s per round, the medians, each gateway's ratio to
direct (of the medians, and the median of per-round ratios), then one JSON line.

    .venv/bin/python scripts/gateway_overhead.py [--model PATH] [--concurrency 16]
        [--requests 64] [--max-tokens 32] [--rounds 3] [--transports grpc,http]

``--model``: default, tokenwire's default model. Target: ratio >= 0.90.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai

MODEL = "bench"
SERVING = re.compile(r'"grpc": "(\S+:\d+)", "rest": "(\S+)"')
PROMPTS = [
    f"Request {i}: write a short story about a {animal} who learns to {skill}."
    for i, (animal, skill) in enumerate(
        (a, s) for a in ("fox", "crow", "whale", "cat") for s in ("sing", "code", "sail", "paint")
    )
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def exe(name: str) -> str:
    found = shutil.which(name, path=os.path.dirname(sys.executable))
    assert found is not None, f"{name} is not installed in this environment"
    return found


@contextmanager
def replica(model: str | None, max_model_len: int) -> Iterator[tuple[str, str]]:
    """``tokenwire serve``: yields (grpc host:port, rest url)."""
    cmd = [exe("tokenwire"), "serve", *([model] if model else []), "--served-model-name", MODEL]
    cmd += ["--grpc-port", "0", "--port", "0", "--log-format", "json"]
    cmd += ["--worker-protocol", "vllm", "--max-model-len", str(max_model_len)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = SERVING.search(line)
            if match:
                break
        else:
            raise SystemExit("tokenwire serve exited before serving")
        out = proc.stdout  # keep the pipe read so the server never blocks on its logs
        threading.Thread(target=lambda: [None for _ in out], daemon=True).start()
        yield match.group(1), match.group(2)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


@contextmanager
def gateway(worker_url: str) -> Iterator[str]:
    port, metrics = free_port(), free_port()
    fd, log_path = tempfile.mkstemp(prefix="smg-", suffix=".log")
    cmd = [exe("smg"), "launch", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
    cmd += ["--worker-urls", worker_url, "--policy", "round_robin", "--log-level", "warn"]
    cmd += ["--shutdown-grace-period-secs", "1"]
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # ready: it answers a one-token request (tokenizer fetched)
            assert proc.poll() is None, f"smg exited (log: {log_path})"
            try:
                probe = httpx.post(
                    f"{url}/v1/completions",
                    json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                    timeout=30,
                )
                if probe.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"smg not ready (log: {log_path})"
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def run_load(url: str, concurrency: int, requests: int, max_tokens: int) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    tokens = 0
    texts: dict[int, str] = {}

    async def worker() -> None:
        nonlocal tokens
        while not queue.empty():
            i = queue.get_nowait()
            reply = await client.completions.create(
                model=MODEL,
                prompt=PROMPTS[i % len(PROMPTS)],
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert reply.usage is not None
            tokens += reply.usage.completion_tokens
            texts[i] = reply.choices[0].text

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    await client.close()
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "texts": texts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the default model)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--transports", default="grpc,http")
    args = p.parse_args()
    # SIGTERM unwinds like Ctrl-C: the replica and the gateways are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    transports = [t for t in args.transports.split(",") if t]
    results: dict[str, list[float]] = {"direct": [], **{f"smg-{t}": [] for t in transports}}
    same_text = True
    with replica(args.model, args.max_model_len) as (grpc_target, rest_url):
        urls = {"direct": rest_url}
        stack = []
        for t in transports:
            cm = gateway(f"grpc://{grpc_target}" if t == "grpc" else rest_url)
            urls[f"smg-{t}"] = cm.__enter__()
            stack.append(cm)
        try:
            asyncio.run(run_load(rest_url, 2, 4, 4))  # warm the replica
            names = list(urls)
            for round_index in range(args.rounds):
                reference: dict[int, str] | None = None
                shift = round_index % len(names)  # interleaved, the order rotating per round
                for name in names[shift:] + names[:shift]:
                    url = urls[name]
                    run = asyncio.run(
                        run_load(url, args.concurrency, args.requests, args.max_tokens)
                    )
                    results[name].append(run["tok_s"])
                    if reference is None:
                        reference = run["texts"]
                    same_text = same_text and run["texts"] == reference
        finally:
            for cm in reversed(stack):
                cm.__exit__(None, None, None)
    report(args, results, same_text)


def report(args: argparse.Namespace, results: dict[str, list[float]], same_text: bool) -> None:
    direct = statistics.median(results["direct"])
    print(
        f"output tok/s, concurrency {args.concurrency}, {args.requests} requests x "
        f"{args.max_tokens} tokens, greedy; rounds interleaved"
    )
    # Per-round ratio (target / direct of the same round): robust to the box's load drifting
    # between rounds, which moves every target of a round together.
    print(f"{'target':<10} {'rounds':<36} {'median':>8} {'vs direct':>10} {'paired':>8}")
    summary: dict[str, Any] = {}
    for name, values in results.items():
        median = statistics.median(values)
        ratio = median / direct
        paired = statistics.median(v / d for v, d in zip(values, results["direct"], strict=True))
        rounds = " ".join(f"{v:.1f}" for v in values)
        print(f"{name:<10} {rounds:<36} {median:>8.1f} {ratio:>10.3f} {paired:>8.3f}")
        summary[name] = {
            "tok_s": round(median, 2),
            "ratio": round(ratio, 4),
            "paired_ratio": round(paired, 4),
            "rounds": [round(v, 2) for v in values],
        }
    print(f"greedy texts identical across targets: {same_text}")
    print(
        json.dumps(
            {
                "bench": "gateway_overhead",
                "model": args.model or "default",
                "concurrency": args.concurrency,
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "same_text": same_text,
                **summary,
            }
        )
    )


if __name__ == "__main__":
    main()
