"""The ``kvtier`` stage of ``gpu_check.py`` (issue 29): the host KV tier's two figures on a
GPU, from ``kv_offload_bench.py`` (beside this file) at a 1B model's scale.

Llama-3.2-1B (bundled config, dummy bf16 weights) on the device, the device KV cache cut to
about a quarter of the conversations' transcripts, the host tier in pinned host memory
(copies on a side stream):

- ``kv_tier_multi_turn``: 64 conversations x 5 turns (a 1024-token system prefix, 256 new
  user tokens and 64 output tokens a turn; the last transcript is 2624 tokens), 16 in
  flight, served turn-major, tier off then on: prompt tokens computed and TTFT p50 / p99,
  and their ratios (targets: >= 3x fewer prefill tokens, TTFT p50 <= 0.5x);
- ``kv_tier_no_reuse``: 256 unique 1024-token prompts, 64 output tokens each, tier off and
  on alternating 3 times (best of each): output throughput on / off (target >= 0.97).

``--smoke``: the script's own tiny random Llama on the CPU in float32, tiny counts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Protocol

SCRIPTS = Path(__file__).resolve().parent

# (flag, value) of kv_offload_bench.py for each scale.
GPU_ARGS = {
    "--model": "llama-3.2-1b", "--dummy": None, "--device": "cuda", "--dtype": "bfloat16",
    "--conversations": "64", "--turns": "5", "--system-tokens": "1024",
    "--user-tokens": "256", "--output-tokens": "64", "--concurrency": "16",
    "--offload-gib": "8", "--max-model-len": "4096", "--unique-requests": "256",
    "--unique-prompt-tokens": "1024", "--reps": "3",
}  # fmt: skip
SMOKE_ARGS = {
    "--conversations": "8", "--turns": "2", "--system-tokens": "32", "--user-tokens": "16",
    "--output-tokens": "4", "--concurrency": "2", "--offload-gib": "0.05",
    "--max-model-len": "256", "--unique-requests": "4", "--unique-prompt-tokens": "32",
    "--reps": "1",
}  # fmt: skip


class Record(Protocol):
    def __call__(self, **record: Any) -> None: ...


def bench_argv(smoke: bool) -> list[str]:
    """kv_offload_bench.py's command line for the stage."""
    argv: list[str] = []
    for flag, value in (SMOKE_ARGS if smoke else GPU_ARGS).items():
        argv += [flag] if value is None else [flag, value]
    return argv


def _multi_turn_record(results: dict[str, Any]) -> dict[str, Any]:
    off, on = results["multi_turn_off"], results["multi_turn_on"]
    return dict(
        kind="kv_tier_multi_turn",
        device_blocks=results["device_blocks"],
        prefill_tokens_off=off["prefill_tokens"], prefill_tokens_on=on["prefill_tokens"],
        prefill_ratio=round(results["prefill_ratio_off_over_on"], 3),
        ttft_p50_ms_off=round(off["ttft_p50_ms"], 2), ttft_p50_ms_on=round(on["ttft_p50_ms"], 2),
        ttft_p99_ms_off=round(off["ttft_p99_ms"], 2), ttft_p99_ms_on=round(on["ttft_p99_ms"], 2),
        ttft_p50_ratio=round(results["ttft_p50_on_over_off"], 3),
        blocks_saved=on["blocks_saved"], blocks_loaded=on["blocks_loaded"],
    )  # fmt: skip


def stage_kvtier(args: argparse.Namespace, record: Record) -> None:
    """Run the bench at the stage's scale; record the two figures as they are known."""
    sys.path.insert(0, str(SCRIPTS))
    import torch
    from kv_offload_bench import measure, parser

    bench = parser().parse_args(bench_argv(args.smoke))
    if args.smoke:
        torch.set_num_threads(1)
    label = "tiny" if args.smoke else "llama-3.2-1b"
    # The multi-turn figures are recorded as soon as they are known (a cap may cut the rest).
    results = measure(bench, lambda done: record(model=label, **_multi_turn_record(done)))
    off, on = results["no_reuse_off"], results["no_reuse_on"]
    record(kind="kv_tier_no_reuse", model=label,
           output_tok_s_off=round(off["output_tok_per_s"], 1),
           output_tok_s_on=round(on["output_tok_per_s"], 1),
           throughput_ratio=round(results["no_reuse_throughput_on_over_off"], 4))  # fmt: skip
