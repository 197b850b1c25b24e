#!/usr/bin/env python3
"""Responses API: TTFT of a ``previous_response_id`` continuation vs a fresh request with the
same full history (issue 31's figure), alternating in one run against one server.

Starts ``tokenwire serve`` (the default model unless ``--model``), builds a stored
conversation whose first input is ``--history-words`` words long, then per round streams
(a) a continuation (``previous_response_id``: the stored KV is reused) and (b) the same full
history as input items with ``store: false`` and a fresh ``cache_salt`` (nothing reused), and
times the first ``response.output_text.delta`` of each. Prints a table and one JSON line.

    .venv/bin/python scripts/responses_ttft.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import httpx

EXE = shutil.which("tokenwire", path=os.path.dirname(sys.executable)) or "tokenwire"
ENV = dict(os.environ, PYTHONSAFEPATH="1")
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "judge",
    "boxing",
]


def start_server(extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [EXE, "serve", "--grpc-port", "0", "--port", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"serving model=.* grpc=(\S+:\d+) rest=(\S+)", line)
        if match:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, match.group(2)
    raise RuntimeError("serve exited before serving")


def stream(client: httpx.Client, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(seconds to the first text delta, the final response object)."""
    start = time.perf_counter()
    first = None
    final: dict[str, Any] = {}
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta" and first is None:
                first = time.perf_counter() - start
            elif event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
    if first is None:
        raise RuntimeError(f"no text delta: {final}")
    return first, final


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--history-words", type=int, default=400)
    p.add_argument("--max-output-tokens", type=int, default=8)
    p.add_argument("--model", default=None, help="model for tokenwire serve (default model)")
    args = p.parse_args()
    proc, url = start_server([args.model] if args.model else [])
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            rows = run(client, args)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    report(rows, args)


def run(client: httpx.Client, args: argparse.Namespace) -> list[dict[str, float]]:
    text = " ".join(WORDS[i % len(WORDS)] for i in range(args.history_words))
    common = {"model": "", "max_output_tokens": args.max_output_tokens, "temperature": 0.0}
    models = client.get("/v1/models").json()["data"]
    common["model"] = models[0]["id"]
    _, previous = stream(client, {**common, "input": f"Summarize: {text}"})
    history: list[dict[str, Any]] = [{"role": "user", "content": f"Summarize: {text}"}]
    history.append({"role": "assistant", "content": _text(previous)})
    rows = []
    for i in range(args.rounds):
        question = f"Question {i}: and then?"
        fresh_body = {
            **common,
            "input": [*history, {"role": "user", "content": question}],
            "store": False,
            "cache_salt": uuid.uuid4().hex,
        }
        fresh_ttft, fresh = stream(client, fresh_body)
        cont_body = {**common, "previous_response_id": previous["id"], "input": question}
        cont_ttft, cont = stream(client, cont_body)
        usage = cont["usage"]
        rows.append(
            {
                "round": i,
                "continuation_ttft_ms": cont_ttft * 1e3,
                "fresh_ttft_ms": fresh_ttft * 1e3,
                "input_tokens": usage["input_tokens"],
                "fresh_input_tokens": fresh["usage"]["input_tokens"],
                "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
                "fresh_cached_tokens": fresh["usage"]["input_tokens_details"]["cached_tokens"],
            }
        )
        history += [{"role": "user", "content": question}]
        history.append({"role": "assistant", "content": _text(cont)})
        previous = cont
    return rows


def _text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def report(rows: list[dict[str, float]], args: argparse.Namespace) -> None:
    print(f"{'round':>5} {'input':>6} {'cached':>6} {'cont ms':>9} {'fresh ms':>9} {'ratio':>6}")
    for r in rows:
        ratio = r["continuation_ttft_ms"] / r["fresh_ttft_ms"]
        print(
            f"{r['round']:>5} {r['input_tokens']:>6} {r['cached_tokens']:>6} "
            f"{r['continuation_ttft_ms']:>9.1f} {r['fresh_ttft_ms']:>9.1f} {ratio:>6.2f}"
        )
    cont = statistics.median(r["continuation_ttft_ms"] for r in rows)
    fresh = statistics.median(r["fresh_ttft_ms"] for r in rows)
    summary = {
        "bench": "responses_ttft",
        "rounds": len(rows),
        "history_words": args.history_words,
        "median_continuation_ttft_ms": round(cont, 1),
        "median_fresh_ttft_ms": round(fresh, 1),
        "ratio": round(cont / fresh, 3),
        "rows": rows,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
