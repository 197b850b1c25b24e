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
``gpu``-marked kernel tests first, the remaining kernel tests last in whatever time is left.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STAGES_PY = REPO / "scripts" / "gpu_check_stages.py"
# Smoke stand-ins (tiny-<family>) of the bundled configs the full run benches.
SMOKE_FAMILIES = ("mla", "gpt-oss")
# Namespace package -> repo folder (pyproject's package-dir map).
PACKAGE_DIRS = {
    "runtime": "runtime",
    "kernels": "kernels",
    "server": "server",
    "clients": "clients",
    "bench": "bench",
    "v1": "protos/tokenwire/v1",
}


@dataclass
class Stage:
    name: str
    command: list[str]
    cap_s: float  # this stage's own time limit (seconds)
    status: str = "not run"
    seconds: float = 0.0
    detail: str = ""
    records: list[dict[str, Any]] = field(default_factory=list)


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


def plan(args: argparse.Namespace, results: Path) -> list[Stage]:
    stage = _StageMaker(results, args.smoke)
    if args.smoke:  # the compiled kernel tests skip without CUDA; keep the smoke run short
        return _smoke_plan(stage, results)
    return _full_plan(stage)


@dataclass(frozen=True)
class _StageMaker:
    """Makes the stage of one ``gpu_check_stages.py`` command: ``name`` is ``kind[:label]``."""

    results: Path
    smoke: bool

    def __call__(self, name: str, cap: float, *extra: str) -> Stage:
        kind = name.split(":")[0]
        smoke = ["--smoke"] if self.smoke else []
        cmd = [sys.executable, str(STAGES_PY), kind, "--results", str(self.results), *smoke, *extra]
        return Stage(name, cmd, cap)


KERNEL_TEST_FILES = (
    "tests/kernels/test_kernels_triton.py",
    "tests/kernels/test_kernels_mla_decode.py",
)


def _kernel_tests(marker: str, *files: str) -> list[str]:
    """A pytest command over ``files`` selecting ``-m marker``, 60 s per test."""
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "60"]
    return [*pytest, "-m", marker, *files]


def _gpu_tests() -> list[str]:
    """The `gpu`-marked kernel and sampler tests: the first stage."""
    return _kernel_tests("gpu", *KERNEL_TEST_FILES, "tests/runtime/test_sampler.py")


def _smoke_plan(stage: _StageMaker, results: Path) -> list[Stage]:
    """The plumbing test: the same stage kinds on tiny models, tens of seconds each."""
    tiny = str(results.parent / "tiny-config")
    tiny_moe = str(results.parent / "tiny-moe-config")
    return [
        Stage("kernels", _gpu_tests(), 40),
        stage("attn_bw", 10),
        stage("parity", 40),
        stage("bench:tiny", 40, "--model", tiny, "--hf"),
        stage("serve:tiny", 40, "--model", tiny, "--vocab", "1024", "--ready-timeout", "30"),
        stage(
            "bench:tiny+kvfp8",
            30,
            "--model",
            tiny,
            "--label",
            "tiny+kvfp8",
            "--kv-cache-dtype",
            "fp8",
            "--tpot-only",
        ),
        stage("lora:tiny", 60, "--model", tiny),
        stage("bench:tiny-moe", 30, "--model", tiny_moe, "--label", "tiny-moe"),
        # Issue 32's families: the bundled configs shrunk (MLA + DeepSeekMoE; sinks,
        # windows and gpt-oss's MoE).
        *(stage(f"bench:tiny-{f}", 30, *_family_args(results, f)) for f in SMOKE_FAMILIES),
        stage("spec:tiny", 30, "--model", tiny),
        stage(
            "bench:tiny+async",
            30,
            "--model",
            tiny,
            "--label",
            "tiny+async",
            "--async-scheduling",
            "--tpot-only",
        ),
        # Issue 33: the VLM stage on a tiny Qwen2.5-VL stand-in (64-pixel images).
        stage("vlm:tiny-vlm", 40, "--label", "tiny-vlm", "--image-side", "64"),
        # Issue 29: the host KV tier's figures on the bench script's tiny Llama.
        stage("kvtier:tiny", 30, "--label", "tiny"),
    ]


def _full_plan(stage: _StageMaker) -> list[Stage]:
    """The H200 run, in priority order (the rest of the kernel tests last, in the time left)."""
    return [
        Stage("kernels", _gpu_tests(), 50),
        stage("attn_bw", 20),
        stage("parity", 45),
        stage("bench:llama-3.2-1b", 90, "--model", "llama-3.2-1b", "--hf"),
        # Issue 43: the same 1B with async scheduling (mixed + TPOT): decides the default.
        stage(
            "bench:llama-3.2-1b+async",
            60,
            "--model",
            "llama-3.2-1b",
            "--label",
            "llama-3.2-1b+async",
            "--async-scheduling",
        ),
        stage("bench:qwen3-0.6b", 50, "--model", "qwen3-0.6b"),
        stage("bench:llama-3.1-8b", 120, "--model", "llama-3.1-8b", "--hf"),
        stage("serve:llama-3.2-1b", 70, "--model", "llama-3.2-1b", "--ready-timeout", "40"),
        # Issue 13: FP8 weights vs the bf16 8B above (mixed + TPOT), FP8 KV cache (blocks and
        # mixed), INT4 (GPTQ layout, random codes) TPOT at batch 1.
        stage("bench:llama-3.1-8b+fp8", 100, *_eight_b("fp8", quantization="fp8")),
        stage("bench:llama-3.1-8b+kvfp8", 100, *_eight_b("kvfp8", kv_cache_dtype="fp8")),
        stage("bench:llama-3.1-8b+int4", 70, *_eight_b("int4", quantization="gptq"), "--tpot-only"),
        # Issue 15: 4 LoRA adapters mixed vs the base, Llama-3.2-1B dummy weights.
        stage("lora:llama-3.2-1b", 90, "--model", "llama-3.2-1b"),
        # Issue 16: n-gram speculation vs plain, 1 and 64 streams (a copying dummy model).
        stage("spec:llama-3.2-1b", 60, "--model", "llama-3.2-1b"),
        # Issue 33: Qwen2.5-VL-3B (dummy bf16), 448-pixel images (256 image tokens each):
        # image+text throughput, TTFT of a repeated image (encoder-output cache) vs a new one.
        stage("vlm:qwen2.5-vl-3b", 80, "--model", "qwen2.5-vl-3b"),
        # Issue 29: the host KV tier on Llama-3.2-1B (dummy bf16): 64 conversations x 5 turns
        # with the device cache at ~1/4 of them, tier off vs on (prefill tokens, TTFT); 256
        # unique prompts, throughput on / off.
        stage("kvtier:llama-3.2-1b", 150, "--model", "llama-3.2-1b"),
        # Issue 17: Mixtral-8x7B (~93 GB of bf16 dummy weights, top-2 of 8 experts through
        # the fused-MoE Triton kernel), mixed + TPOT next to their floors. The longest extra
        # stage (its weights alone take a while to draw), so after the cheaper ones.
        stage("bench:mixtral-8x7b", 150, "--model", "mixtral-8x7b"),
        # Issue 32: MLA (the Triton MLA decode kernel over the latent cache) + DeepSeekMoE, and
        # gpt-oss (sinks, alternating 128-token windows, 32 experts top 4; bf16 experts): mixed
        # + TPOT next to their floors (batch-1 floor: the active weights' bytes).
        stage("bench:deepseek-v2-lite", 120, "--model", "deepseek-v2-lite"),
        stage("bench:gpt-oss-20b", 120, "--model", "gpt-oss-20b"),
        Stage("kernels-all", _kernel_tests("not gpu", *KERNEL_TEST_FILES), 120),
    ]


def _family_args(results: Path, family: str) -> list[str]:
    """Bench arguments for the smoke stand-in of a ``SMOKE_FAMILIES`` bundled config."""
    return ["--model", str(results.parent / f"tiny-{family}"), "--label", f"tiny-{family}"]


def _eight_b(tag: str, **flags: str) -> list[str]:
    """Bench arguments for Llama-3.1-8B (dummy weights) under issue 13's flags."""
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    return ["--model", "llama-3.1-8b", "--label", f"llama-3.1-8b+{tag}", *extra]


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
    cmd = stage.command
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
    p.add_argument("--budget-s", type=float, default=None, help="total time (default 480/300)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for JSON and logs")
    p.add_argument("--only", default=None, help="comma-separated stage names to run")
    args = p.parse_args(argv)
    budget = args.budget_s or (300.0 if args.smoke else 480.0)
    deadline = time.monotonic() + budget
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
