"""The stage list of ``gpu_check.py``: which stages run, in which order, under which caps.

Stage order is priority order: the compiled ``gpu``-marked kernel tests first, the figure
stages next (the cheaper and more decisive first), the remaining kernel tests last in
whatever time is left. A stage's cap is its own time limit; the orchestrator runs it for
``min(cap, time left)``, so a full run stays within its budget whatever the caps add up to
and the later stages are the ones cut (run them with ``--only``). ``--smoke`` runs the same
stage kinds on tiny stand-ins on the CPU.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STAGES_PY = REPO / "scripts" / "gpu_check_stages.py"
# Smoke stand-ins (tiny-<family>) of the bundled configs the full run benches.
SMOKE_FAMILIES = ("mla", "gpt-oss")


@dataclass
class Stage:
    name: str
    command: list[str]
    cap_s: float  # this stage's own time limit (seconds)
    status: str = "not run"
    seconds: float = 0.0
    detail: str = ""
    records: list[dict[str, Any]] = field(default_factory=list)


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
        # Issue 34: a tiny Qwen3 embedding model against HF's forward; data parallel 2 vs 1
        # served on the CPU (two engine-core processes; no GPU count check with --smoke).
        stage("embed:tiny-embed", 40, "--label", "tiny-embed"),
        stage(
            "dp:tiny",
            90,
            "--model",
            tiny,
            "--label",
            "tiny",
            "--vocab",
            "1024",
            "--ready-timeout",
            "40",
        ),
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
        # Its second engine (enforce_eager) and graph capture: a longer cap than before.
        stage("lora:llama-3.2-1b", 150, "--model", "llama-3.2-1b"),
        # Issue 16: n-gram speculation vs plain, 1 and 64 streams (a copying dummy model).
        stage("spec:llama-3.2-1b", 90, "--model", "llama-3.2-1b"),  # + verify graphs set aside
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
        # Issue 34: Qwen3-Embedding-0.6B's shape (random bf16 weights, LAST pooling), 1024 inputs
        # of 256 tokens, against HF's forward in batches of 64, vectors compared.
        stage("embed:qwen3-0.6b", 60, "--model", "qwen3-0.6b"),
        # Issue 34: served mixed with --data-parallel-size 2 vs 1 (two server starts). Needs two
        # GPUs: with one it records its skip in a second or two.
        stage("dp:llama-3.2-1b", 150, "--model", "llama-3.2-1b", "--ready-timeout", "60"),
        Stage("kernels-all", _kernel_tests("not gpu", *KERNEL_TEST_FILES), 120),
    ]


def _family_args(results: Path, family: str) -> list[str]:
    """Bench arguments for the smoke stand-in of a ``SMOKE_FAMILIES`` bundled config."""
    return ["--model", str(results.parent / f"tiny-{family}"), "--label", f"tiny-{family}"]


def _eight_b(tag: str, **flags: str) -> list[str]:
    """Bench arguments for Llama-3.1-8B (dummy weights) under issue 13's flags."""
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    return ["--model", "llama-3.1-8b", "--label", f"llama-3.1-8b+{tag}", *extra]
