"""Command-line hygiene (defects issue, item 19): ``make serve ARGS="..."`` passes the flags
on, ``tokenwire generate`` sizes its CPU KV cache to its one prompt instead of reserving the
server's 2 GiB, and console logs carry colour codes only on a terminal."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tokenwire.runtime.llm import LLM
from tokenwire.server.cli import build_parser, generate_engine_args

REPO = Path(__file__).resolve().parents[2]
_PEAK_RSS = """
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
assert done.returncode == 0, done.stderr[-2000:]
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)  # KiB, this one child
"""


def test_make_serve_passes_args() -> None:
    done = subprocess.run(
        ["make", "-n", "serve", "ARGS=--grpc-port 50099 --port 0 /models/x"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    (line,) = [ln for ln in done.stdout.splitlines() if "tokenwire serve" in ln]
    assert line.endswith("tokenwire serve --grpc-port 50099 --port 0 /models/x"), line


def _generate_args(*flags: str) -> LLM:
    args = build_parser().parse_args(["generate", "hi", *flags])
    return LLM.from_engine_args(generate_engine_args(args))


def test_generate_cache_holds_one_sequence(tiny_model_with_tokenizer: Path) -> None:
    model = ["--model", str(tiny_model_with_tokenizer), "--device", "cpu"]
    llm = _generate_args(*model, "--max-model-len", "256")
    assert llm.engine.facts.num_blocks == 1 + 256 // 16  # the null block + one sequence
    explicit = _generate_args(*model, "--max-model-len", "256", "--kv-cache-memory", "4194304")
    assert explicit.engine.facts.num_blocks > 1 + 256 // 16  # the flag is taken as given


def test_generate_does_not_reserve_the_server_budget(tiny_model_with_tokenizer: Path) -> None:
    """A real ``tokenwire generate`` of a tiny model stays far below the 2 GiB a server's
    default CPU cache takes (it was 2.5 GiB peak RSS; torch alone is a few hundred MiB)."""
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
    assert exe is not None
    cmd = [exe, "generate", "hello", "--model", str(tiny_model_with_tokenizer), "--device", "cpu"]
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, *cmd, "--max-tokens", "4"],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
        timeout=300,
    )
    peak_mib = int(done.stdout.split()[-1]) / 1024
    assert peak_mib < 1200, peak_mib
