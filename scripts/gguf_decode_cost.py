"""Default model (SmolLM2-135M Q4_1 GGUF) through the LLM API: de-quantized vs kept quantized.

Variants, each in its own process (so RSS is its own), run interleaved A/B/C, A/B/C, ...:
- ``fp32``: ``--dtype float32`` -- today's path, the GGUF de-quantized to float32;
- ``gguf``: ``--dtype auto`` -- the default: float32 model, int4 linears kept quantized on
  torch's bf16 int4 kernel (for every call, whatever its number of rows);
- ``bf16``: ``--dtype bfloat16`` -- de-quantized to bfloat16 (no int4 kernel), the ablation.

Per process: RSS after load, weight bytes, batch-1 greedy decode tok/s (128 tokens, after a
warm-up request) and a 32-prompt batch (200-token prompts, 32 output tokens) in output tok/s.
Prints one JSON line per run and the medians per variant, with the load average.

    .venv/bin/python scripts/gguf_decode_cost.py [--rounds 2] [--variants fp32,gguf,bf16]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

_VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"},
    "gguf": {},
    "bf16": {"dtype": "bfloat16"},
}


def _child(variant: str, threads: int) -> dict[str, Any]:
    import psutil
    import torch

    torch.set_num_threads(threads)

    from tokenwire.runtime.llm import LLM
    from tokenwire.runtime.sampling_params import SamplingParams

    # A KV cache just big enough for the batch, so the RSS shows the weights' difference.
    llm = LLM(max_model_len=512, num_gpu_blocks_override=600, **_VARIANTS[variant])
    rss = psutil.Process().memory_info().rss
    facts = llm.engine.facts
    one = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    llm.generate(["Warm-up."], SamplingParams(max_tokens=8, temperature=0.0))
    start = time.perf_counter()
    out = llm.generate("Tell me a story about a lighthouse keeper.", one)
    decode_s = time.perf_counter() - start
    n_one = len(out[0].outputs[0].token_ids)
    prompts = [[100 + (7 * i + 13 * j) % 20000 for j in range(200)] for i in range(32)]
    batch = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, batch, use_tqdm=False)
    batch_s = time.perf_counter() - start
    n_batch = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "variant": variant,
        "rss_mib": round(rss / 2**20, 1),
        "weight_mib": round(facts.weight_bytes / 2**20, 1),
        "quantization": facts.quantization,
        "dtype": facts.dtype,
        "batch1_tok_s": round(n_one / decode_s, 2),
        "batch32_out_tok_s": round(n_batch / batch_s, 2),
        "batch32_s": round(batch_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default="fp32,gguf,bf16")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (on a shared 2-core box, 2 "
        "threads wait out other processes' time slices: ~12 ms per op)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.threads)))
        return
    runs: list[dict[str, Any]] = []
    variants = args.variants.split(",")
    for _ in range(args.rounds):
        for variant in variants:
            cmd = [sys.executable, __file__, "--child", variant, "--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            run = json.loads(out.strip().splitlines()[-1])
            run["loadavg_1m"] = round(os.getloadavg()[0], 2)
            print(json.dumps(run), flush=True)
            runs.append(run)
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant]
        keys = ("rss_mib", "batch1_tok_s", "batch32_out_tok_s", "loadavg_1m")
        medians = {k: statistics.median(r[k] for r in mine) for k in keys}
        print(json.dumps({"median": variant, "weight_mib": mine[0]["weight_mib"], **medians}))


if __name__ == "__main__":
    main()
