#!/usr/bin/env python3
"""KV tier eviction policies (``--kv-offloading-eviction-policy``), LRU vs ARC in one run: the
multi-turn workload of ``kv_offload_bench.py`` with a scan between turns — after every turn of
the conversations, ``--scan-requests`` unique prompts (a batch job, a crawler) pass through.

The host tier holds about ``--host-fraction`` of the conversations' final transcripts, and
each scan saves more blocks than the whole tier holds. Under LRU a scan flushes the
conversations' blocks and every next turn recomputes its transcript; under ARC the blocks a
conversation already reused (a hit moves them to ARC's frequent list) outlive the once-used
scan blocks. Reported per policy: prompt tokens computed for the conversation turns, their
cached prompt tokens, their TTFT p50/p99, host-tier blocks loaded, and the scans' output
throughput (the policy must not tax the scan itself). An in-process ``EngineCore`` on
``kv_offload_bench.py``'s random-weight Llama; ``--tier disk`` puts the same-sized tier on
disk under a one-block host tier instead.

    .venv/bin/python scripts/kv_tier_policy_bench.py     # prints a table and one JSON line
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from tokenwire.runtime.engine.core import EngineCore
from tokenwire.runtime.engine_args import EngineArgs
from tokenwire.runtime.stats import StepRecorder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_offload_bench import MODEL_CONFIG, run_jobs

BLOCK = 16
# K and V of one token of MODEL_CONFIG's layers, float32.
_heads = MODEL_CONFIG["num_key_value_heads"]
_head_dim = MODEL_CONFIG["hidden_size"] // MODEL_CONFIG["num_attention_heads"]
BLOCK_BYTES = 2 * MODEL_CONFIG["num_hidden_layers"] * _heads * _head_dim * 4 * BLOCK


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=96)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--scan-requests", type=int, default=10, help="~half the host tier")
    p.add_argument("--scan-prompt-tokens", type=int, default=192)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--host-fraction", type=float, default=1.0, help="tier / final transcripts")
    p.add_argument("--tier", choices=("host", "disk"), default="host")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p


def tier_blocks(args: argparse.Namespace) -> tuple[int, int]:
    """(device blocks, tier blocks): the device holds ~1/4 of the final transcripts."""
    final = args.system_tokens + args.turns * (args.user_tokens + args.output_tokens)
    transcripts = args.conversations * -(-final // BLOCK)
    device = max(args.max_model_len // BLOCK + 1, transcripts // 4)
    return device, max(1, int(transcripts * args.host_fraction))


def make_engine(args: argparse.Namespace, model: str, policy: str, tmp: str) -> EngineCore:
    device, tier = tier_blocks(args)
    gib = tier * BLOCK_BYTES / 2**30
    disk = args.tier == "disk"
    config = EngineArgs(
        model=model,
        load_format="dummy",
        max_model_len=args.max_model_len,
        num_gpu_blocks_override=device + 1,
        max_num_seqs=args.concurrency,
        kv_offloading_size=BLOCK_BYTES / 2**30 if disk else gib,
        kv_offloading_disk_path=tempfile.mkdtemp(dir=tmp) if disk else None,
        kv_offloading_disk_size=gib if disk else None,
        kv_offloading_eviction_policy=policy,  # type: ignore[arg-type]
        seed=0,
    ).create_engine_config()
    return EngineCore(config, StepRecorder())


def scanned_turns(core: EngineCore, args: argparse.Namespace) -> dict[str, Any]:
    """The conversations turn-major, a scan of unique prompts after each turn."""
    rng = random.Random(1)
    transcripts = [
        [rng.randrange(3, 4000) for _ in range(args.system_tokens)]
        for _ in range(args.conversations)
    ]
    scan_s = 0.0
    for turn in range(args.turns):
        jobs: deque[tuple[str, list[int]]] = deque()
        for c, transcript in enumerate(transcripts):
            transcript.extend(rng.randrange(3, 4000) for _ in range(args.user_tokens))
            jobs.append((f"c{c}-t{turn}", list(transcript)))
        outs = run_jobs(core, jobs, args.concurrency, args.output_tokens)
        for c, transcript in enumerate(transcripts):
            transcript.extend(outs[f"c{c}-t{turn}"])
        scan = deque(
            (f"s{turn}-{i}", [rng.randrange(3, 4000) for _ in range(args.scan_prompt_tokens)])
            for i in range(args.scan_requests)
        )
        t0 = time.perf_counter()
        run_jobs(core, scan, args.concurrency, args.output_tokens)
        scan_s += time.perf_counter() - t0
    return summarize(core, args, scan_s)


def summarize(core: EngineCore, args: argparse.Namespace, scan_s: float) -> dict[str, Any]:
    recorder = core.observer
    assert isinstance(recorder, StepRecorder)
    turns = [r for r in recorder.requests if r.request_id.startswith("c")]
    later = [r for r in turns if not r.request_id.endswith("-t0")]  # turn 0 has no history
    ttfts = sorted(
        r.first_token_time - r.arrival_time for r in later if r.first_token_time is not None
    )
    prompt = sum(r.num_prompt_tokens for r in later)
    cached = sum(r.num_cached_tokens for r in later)
    connector = core.scheduler.connector
    assert connector is not None
    stats = connector.stats()
    return {
        "later_turn_prompt_tokens": prompt,
        "later_turn_prefill_tokens": prompt - cached,
        "later_turn_cached_tokens": cached,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "tier_blocks_loaded": stats.blocks_loaded,
        "scan_output_tok_per_s": args.turns * args.scan_requests * args.output_tokens / scan_s,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device, tier = tier_blocks(args)
    results: dict[str, Any] = {"device_blocks": device, "tier_blocks": tier, "tier": args.tier}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(MODEL_CONFIG))
        for policy in ("lru", "arc"):
            core = make_engine(args, tmp, policy, tmp)
            try:
                results[policy] = scanned_turns(core, args)
            finally:
                core.shutdown()
    lru, arc = results["lru"], results["arc"]
    results["prefill_ratio_lru_over_arc"] = lru["later_turn_prefill_tokens"] / max(
        1, arc["later_turn_prefill_tokens"]
    )
    results["scan_throughput_arc_over_lru"] = (
        arc["scan_output_tok_per_s"] / lru["scan_output_tok_per_s"]
    )
    return results


def report(results: dict[str, Any]) -> None:
    print(
        f"device {results['device_blocks']} blocks, {results['tier']} tier "
        f"{results['tier_blocks']} blocks"
    )
    print(f"{'policy':<7}{'prefill':>10}{'cached':>10}{'TTFT p50':>11}{'p99':>9}{'loaded':>9}")
    for policy in ("lru", "arc"):
        r = results[policy]
        print(
            f"{policy:<7}{r['later_turn_prefill_tokens']:>10}{r['later_turn_cached_tokens']:>10}"
            f"{r['ttft_p50_ms']:>9.1f}ms{r['ttft_p99_ms']:>7.1f}ms{r['tier_blocks_loaded']:>9}"
        )
    print(
        f"later-turn prefill LRU/ARC {results['prefill_ratio_lru_over_arc']:.2f}x; "
        f"scan throughput ARC/LRU {results['scan_throughput_arc_over_lru']:.3f}"
    )
    print(json.dumps(results))


def main() -> None:
    args = parser().parse_args()
    torch.set_num_threads(args.threads)
    report(measure(args))


if __name__ == "__main__":
    main()
