"""Cost of batch-invariant numerics on the default model (defects #20): decode and prefill step
times of the model forward (+ LM head on the rows that need logits), this checkout against a
baseline checkout, each in its own process, interleaved A/B, A/B, ...

Decode: one step of B one-token rows, each over a context of ``--context`` positions (the KV
cache holds zeros: attention costs what it costs, whatever the values), B in ``--batches``;
prefill: one fresh prompt of 256 tokens, and 8 prompts of 128 tokens in one step. Prints one
JSON line per run, then the medians per variant (decode as tok/s = B / step time).

    .venv/bin/python scripts/batch_invariance_cost.py --baseline DIR [--rounds 2]
        [--threads 2] [--context 128] [--batches 1,16,64]

``DIR`` holds a ``tokenwire`` package tree of the baseline code (e.g. ``git archive main``
unpacked into ``DIR/tokenwire``); it goes first on the child's ``PYTHONPATH``.
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

import numpy as np

BLOCK = 16


def _meta(query_lens: list[int], seq_lens: list[int], num_decodes: int) -> Any:
    import torch

    from tokenwire.kernels.attention_metadata import AttentionMetadata
    from tokenwire.kernels.attention_plan import build_cpu_plan

    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    lens = np.asarray(seq_lens, dtype=np.int32)
    width = -(-int(lens.max()) // BLOCK)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    slots: list[int] = []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        ids = torch.arange(1 + i * width, 1 + (i + 1) * width, dtype=torch.int32)
        tables[i] = ids
        slots += [int(ids[p // BLOCK]) * BLOCK + p % BLOCK for p in range(s - q, s)]
    plan = build_cpu_plan(qsl, lens, tables, num_decodes, BLOCK)
    return AttentionMetadata(
        num_tokens=int(qsl[-1]), num_seqs=len(seq_lens), num_decodes=num_decodes,
        block_size=BLOCK, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(lens),
        block_tables=tables, max_query_len=max(query_lens), max_seq_len=int(lens.max()),
        query_start_loc_np=qsl, seq_lens_np=lens, cpu_plan=plan,
    )  # fmt: skip


def _step_seconds(model: Any, query_lens: list[int], seq_lens: list[int], reps: int) -> float:
    """Median wall time of one forward + logits of each sequence's last row."""
    import torch

    from tokenwire.kernels.kv_quant import LayerKVCache

    arch = model.arch
    blocks = 1 + len(seq_lens) * -(-max(seq_lens) // BLOCK)
    shape = (blocks, BLOCK, arch.num_key_value_heads, arch.head_dim)
    kv = [LayerKVCache(torch.zeros(shape), torch.zeros(shape)) for _ in model.model.layers]
    decodes = sum(1 for q in query_lens if q == 1)
    meta = _meta(query_lens, seq_lens, decodes)
    ids = torch.randint(100, 40000, (meta.num_tokens,))
    pairs = zip(query_lens, seq_lens, strict=True)
    positions = torch.tensor([s - q + j for q, s in pairs for j in range(q)])
    ends = torch.tensor(query_lens).cumsum(0) - 1
    times = []
    with torch.no_grad():
        for _ in range(reps + 1):  # the first is a warm-up
            start = time.perf_counter()
            hidden = model(ids, positions, kv, meta)
            model.compute_logits(hidden[ends])
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _child(threads: int, context: int, batches: list[int]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from tokenwire.runtime.config import ModelConfig
    from tokenwire.runtime.loader.model_loader import load_model

    model = load_model(ModelConfig(), torch.device("cpu"), torch.float32).model
    out: dict[str, Any] = {}
    for b in batches:
        step = _step_seconds(model, [1] * b, [context] * b, reps=5)
        out[f"decode_b{b}_tok_s"] = round(b / step, 2)
    out["prefill_256_s"] = round(_step_seconds(model, [256], [256], reps=2), 3)
    out["prefill_8x128_s"] = round(_step_seconds(model, [128] * 8, [128] * 8, reps=1), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="folder holding the baseline tokenwire")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(_child(args.threads, args.context, batches)))
        return
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "current": []}
    for _ in range(args.rounds):
        for variant in runs:
            env = dict(os.environ)
            if variant == "baseline":
                paths = [args.baseline, env.get("PYTHONPATH", "")]
                env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
            cmd = [sys.executable, __file__, "--child", "--baseline", args.baseline,
                   "--threads", str(args.threads), "--context", str(args.context),
                   "--batches", args.batches]  # fmt: skip
            line = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            result = json.loads(line.stdout.strip().splitlines()[-1])
            result["variant"] = variant
            print(json.dumps(result), flush=True)
            runs[variant].append(result)
    for variant, results in runs.items():
        keys = [k for k in results[0] if k != "variant"]
        medians = {k: statistics.median(r[k] for r in results) for k in keys}
        print(variant, json.dumps(medians), "load", os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
