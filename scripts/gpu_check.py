#!/usr/bin/env python3
"""The one GPU check (issue 6): kernels, parity, offline and served benchmarks, one summary.

    python3 scripts/gpu_check.py            # on the H200 box, <= 8 minutes
    python3 scripts/gpu_check.py --smoke    # anywhere (CPU, tiny model): tests the plumbing

Every stage runs in its own process under a time limit (``min(stage cap, time left)``), so a
crash, a hang or an out-of-memory in one stage loses only that stage; measurements are
recorded as they finish (JSON lines), so even a stage killed at its limit keeps what it
measured. The summary table is printed last; with ``$OUT`` set (or ``--out``), everything is
written to ``gpu_check.json`` and per-stage logs to ``logs/`` there.

The repo does not need installing: when ``tokenwire`` is not importable, a throwaway folder
of links (``tokenwire/runtime -> runtime`` ...) goes on ``PYTHONPATH`` for every stage.
Figures use dummy bf16 weights from the bundled configs; the HF static baseline runs the
``fixed`` workload as one static batch of 256 (``--hf-requests N`` on a bench stage bounds it
to the first N requests when time is short). Stage order is priority order: the compiled
``gpu``-marked kernel tests first, the remaining kernel tests last in whatever time is left
(the list and its caps: ``gpu_check_plan.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_check_plan import Stage

REPO = Path(__file__).resolve().parents[1]
# Namespace package -> repo folder (pyproject's package-dir map).
PACKAGE_DIRS = {
    "runtime": "runtime",
    "kernels": "kernels",
    "server": "server",
    "clients": "clients",
    "bench": "bench",
    "v1": "protos/tokenwire/v1",
}


def python_env(work: Path) -> dict[str, str]:
    """Environment for stages: ``tokenwire`` importable, repo root never on sys.path."""
    env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1")
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.pop("TRITON_INTERPRET", None)
    if _importable("tokenwire.runtime"):
        return env
    site = work / "site" / "tokenwire"
    site.mkdir(parents=True, exist_ok=True)
    for name, folder in PACKAGE_DIRS.items():
        link = site / name
        if not link.exists():
            link.symlink_to(REPO / folder, target_is_directory=True)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(work / "site"), env.get("PYTHONPATH", "")) if p
    )
    return env


def _importable(name: str) -> bool:
    try:  # find_spec imports the parent package, raising when that is missing
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def run_stage(stage: Stage, env: dict[str, str], left_s: float, logs: Path) -> None:
    timeout = min(stage.cap_s, left_s)
    if timeout < 5:
        stage.status, stage.detail = "skipped", "out of time"
        return
    start = time.monotonic()
    log = logs / f"{stage.name.replace(':', '_')}.log"
    with log.open("w") as out:
        try:
            proc = subprocess.run(
                stage.command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                timeout=timeout, check=False,
            )  # fmt: skip
            stage.status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            stage.status = f"timeout after {timeout:.0f} s"
    stage.seconds = round(time.monotonic() - start, 1)
    text = log.read_text(errors="replace")
    if stage.name.startswith("kernels"):
        found = re.findall(r"=+ (.*?) in [\d.]+s", text) or re.findall(r"\n(\d+ \w+.*?) in ", text)
        stage.detail = found[-1] if found else ""
    if stage.status != "ok":
        tail = text.strip().splitlines()[-12:]
        print(f"--- {stage.name}: {stage.status}; log tail:\n" + "\n".join(tail), flush=True)


def stage_model(stage: Stage) -> str | None:
    """The model name a stage records (``--label`` when given, else ``--model``)."""
    cmd: list[str] = stage.command
    for flag in ("--label", "--model"):
        if flag in cmd:
            return cmd[cmd.index(flag) + 1]
    return None


def read_records(results: Path, stages: list[Stage]) -> None:
    """Attach each recorded measurement to the stage (kind and model) that made it."""
    records = [json.loads(x) for x in results.read_text().splitlines()] if results.exists() else []
    for s in stages:
        kind, model = s.name.split(":")[0], stage_model(s)
        s.records = [
            r
            for r in records
            if r["stage"] == kind and (model is None or r.get("model", model) == model)
        ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny request counts")
    p.add_argument("--budget-s", type=float, default=None, help="total time (default 480/420)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for JSON and logs")
    p.add_argument("--only", default=None, help="comma-separated stage names to run")
    args = p.parse_args(argv)
    budget = args.budget_s or (420.0 if args.smoke else 480.0)
    deadline = time.monotonic() + budget
    sys.path.insert(0, str(REPO / "scripts"))  # the stage list and summary, beside this file
    from gpu_check_plan import SMOKE_FAMILIES, plan

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        out = Path(args.out) if args.out else work
        logs = out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        results = work / "records.jsonl"
        if args.smoke:
            write_tiny_config(work / "tiny-config")
            write_tiny_config(work / "tiny-moe-config", moe=True)
            for family in SMOKE_FAMILIES:
                write_tiny_family_config(work / f"tiny-{family}", family)
        env = python_env(work)
        stages = plan(args, results)
        if args.only:
            wanted = set(args.only.split(","))
            stages = [s for s in stages if s.name in wanted or s.name.split(":")[0] in wanted]
        for stage in stages:
            print(f"=== {stage.name} (cap {stage.cap_s:.0f} s)", flush=True)
            run_stage(stage, env, deadline - time.monotonic(), logs)
            print(f"    {stage.status} in {stage.seconds} s {stage.detail}", flush=True)
        read_records(results, stages)
    from gpu_check_summary import render_summary, summary_rows

    rows = summary_rows(stages)
    report = {
        "smoke": args.smoke,
        "budget_s": budget,
        "stages": [asdict(s) for s in stages],
        "summary": rows,
    }
    if args.out:
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(render_summary(stages, rows), flush=True)
    return 0 if all(s.status == "ok" for s in stages) else 1


def write_tiny_config(folder: Path, moe: bool = False) -> None:
    """The smoke runs' tiny Llama; ``moe``: the same shapes as a Mixtral (top-2 of 4)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_check_stages import SMOKE_CONFIG

    config = dict(SMOKE_CONFIG)
    if moe:
        config.update(
            architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
            num_experts_per_tok=2,
        )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))


def write_tiny_family_config(folder: Path, family: str) -> None:
    """A bundled config (``SMOKE_FAMILIES``) shrunk to the smoke runs' sizes, its family's
    features kept (MLA, DeepSeekMoE routing, sinks, windows)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_check_families import tiny_family_config

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(tiny_family_config(family)))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "scripts"))
    sys.exit(main())
