"""``tokenwire bench throughput`` (offline engine vs HF) and ``tokenwire bench overhead``.

Prints a human table, then ends with one JSON line (DESIGN §9 keys) that machines read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenwire.clients.workloads import WORKLOADS, Workload, make_workload
from tokenwire.runtime.bundled_configs import BUNDLED_CONFIGS
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import RequestStats, StepStats

# A tiny Llama for measuring engine bookkeeping, where the forward pass is nearly free.
TINY_OVERHEAD_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


class StepRecorder:
    """Engine observer that keeps every step and finished-request record (benchmarks only)."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self.requests: list[RequestStats] = []

    def on_step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def on_request_finished(self, stats: RequestStats) -> None:
        self.requests.append(stats)


def add_parsers(bench: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from tokenwire.clients.bench_serve import add_parser as add_serve_parser

    add_serve_parser(bench)
    p = bench.add_parser("throughput", help="offline engine throughput (optionally vs HF)")
    add_throughput_arguments(p)
    p.set_defaults(func=run_throughput)
    o = bench.add_parser("overhead", help="engine overhead per step on a tiny model")
    o.add_argument("--num-seqs", type=int, default=256)
    o.add_argument("--output-len", type=int, default=64)
    o.set_defaults(func=run_overhead)


def add_throughput_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model path, or with --load-format dummy a bundled config name "
        f"({', '.join(BUNDLED_CONFIGS)}); default: SmolLM2",
    )
    p.add_argument("--workload", choices=WORKLOADS, default="cpu")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--compare", choices=["none", "hf"], default="none")
    p.add_argument(
        "--hf-sequential-requests",
        type=int,
        default=8,
        help="HF one-at-a-time runs only this many requests (it is slow; 0 skips it)",
    )
    p.add_argument("--hf-batch-sizes", default="16,32")
    p.add_argument(
        "--hf-num-requests",
        type=int,
        default=None,
        help="HF static batches run only the first N requests (default: all)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode graphs")
    p.add_argument(
        "--floor", action="store_true", help="report the H200 floor (always on for CUDA)"
    )
    p.add_argument(
        "--tpot", type=int, default=0, help="also measure batch-1 TPOT over this many tokens"
    )


def _run_tokenwire(llm: Any, workload: Workload) -> float:
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in workload.output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.num_output_tokens, "engine produced the wrong token count"
    return seconds


def _overhead_ms(steps: list[StepStats], num_seqs: int | None = None) -> float:
    chosen = [s for s in steps if num_seqs is None or s.num_seqs == num_seqs]
    if not chosen:
        return float("nan")
    return 1e3 * statistics.median(s.overhead_time for s in chosen)


def build_llm(args: argparse.Namespace, recorder: StepRecorder) -> Any:
    from tokenwire.runtime.llm import LLM

    return LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        observer=recorder,
    )


def measure_tpot_ms(llm: Any, recorder: StepRecorder, output_len: int) -> float:
    """Batch-1 decode time per output token: one request alone, 128 prompt tokens."""
    vocab = llm.engine.vocab_size
    prompt = [(31 * i + 7) % vocab for i in range(128)]
    recorder.requests.clear()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    llm.generate([prompt], params, use_tqdm=False)
    r = recorder.requests[-1]
    assert r.first_token_time is not None and r.num_output_tokens > 1
    return 1e3 * (r.finished_time - r.first_token_time) / (r.num_output_tokens - 1)


def throughput_result(args: argparse.Namespace) -> dict[str, Any]:
    """Run the offline benchmark and return its JSON record (DESIGN §9 keys)."""
    recorder = StepRecorder()
    llm = build_llm(args, recorder)
    engine = llm.engine
    workload = make_workload(args.workload, engine.vocab_size, args.num_requests)
    llm.generate([workload.prompts[0]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    recorder.steps.clear()
    seconds = _run_tokenwire(llm, workload)
    result: dict[str, Any] = {
        "bench": "throughput",
        "workload": workload.name,
        "model": engine.loaded.served_model_name,
        "device": str(engine.device),
        "dtype": str(engine.loaded.dtype).removeprefix("torch."),
        "enforce_eager": bool(args.enforce_eager),
        "num_requests": len(workload.prompts),
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": workload.num_output_tokens,
        "seconds": round(seconds, 3),
        "tokenwire_output_tok_s": round(workload.num_output_tokens / seconds, 2),
        "tokenwire_total_tok_s": round(
            (workload.num_output_tokens + workload.num_prompt_tokens) / seconds, 2
        ),
        "engine_overhead_ms_per_step": round(_overhead_ms(recorder.steps), 3),
        "num_steps": len(recorder.steps),
        "kv_blocks": engine.runner.num_blocks,
    }
    if args.tpot:
        result["tpot_batch1_ms"] = round(measure_tpot_ms(llm, recorder, args.tpot), 4)
    if args.floor or engine.device.type == "cuda":
        result.update(floor_figures(engine.loaded, workload, args.max_num_seqs))
    if args.compare == "hf":
        from tokenwire.clients.hf_baseline import compare_hf

        model_path, device, dtype = engine.loaded.model_path, engine.device, engine.loaded.dtype
        del llm, engine  # free the KV cache and graphs before HF loads its own copy
        release_device_memory(device)
        result.update(compare_hf(args, model_path, device, dtype, workload))
    return result


def floor_figures(loaded: Any, workload: Workload, max_num_seqs: int) -> dict[str, Any]:
    from tokenwire.clients.roofline import decode_step_floor_s, model_cost, workload_floor

    cost = model_cost(loaded.arch, loaded.dtype.itemsize)
    floor = workload_floor(
        cost, [len(p) for p in workload.prompts], workload.output_lens, max_num_seqs
    )
    return {
        "floor_output_tok_s": round(floor.output_tok_s, 2),
        "floor_seconds": round(floor.seconds, 4),
        "tpot_floor_ms": round(1e3 * decode_step_floor_s(cost, [128]), 4),
        "weight_bytes_per_step": cost.weight_bytes,
        "kv_bytes_per_token": cost.kv_bytes_per_token,
    }


def release_device_memory(device: Any) -> None:
    import gc

    gc.collect()
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.empty_cache()


def run_throughput(args: argparse.Namespace) -> int:
    result = throughput_result(args)
    if args.compare == "hf":
        tw = result["tokenwire_output_tok_s"]
        result["ratio_vs_hf_static"] = round(tw / result["hf_static_output_tok_s"], 2)
        if result.get("hf_sequential_output_tok_s"):
            result["ratio_vs_hf_sequential"] = round(tw / result["hf_sequential_output_tok_s"], 2)
    _print_table(result)
    print(json.dumps(result))
    return 0


def _print_table(r: dict[str, Any]) -> None:
    tw = r["tokenwire_output_tok_s"]
    rows = [("tokenwire (continuous batching)", tw, 1.0)]
    if "hf_static_output_tok_s" in r:
        rows.append(
            (
                f"HF static batch {r['hf_static_best_batch']} (best)",
                r["hf_static_output_tok_s"],
                tw / r["hf_static_output_tok_s"],
            )
        )
    if r.get("hf_sequential_output_tok_s"):
        rows.append(
            (
                f"HF one at a time ({r['hf_sequential_requests']} requests)",
                r["hf_sequential_output_tok_s"],
                tw / r["hf_sequential_output_tok_s"],
            )
        )
    if "floor_output_tok_s" in r:
        rows.append(("H200 floor (bytes/4.25 TB/s + prefill FLOPs)", r["floor_output_tok_s"], 0.0))
    print(
        f"\nworkload={r['workload']} model={r['model']} device={r['device']} "
        f"dtype={r['dtype']} requests={r['num_requests']} "
        f"prompt_tokens={r['prompt_tokens']} output_tokens={r['output_tokens']}"
    )
    print(f"{'engine':44s} {'output tok/s':>14s} {'tokenwire x':>12s}")
    for name, value, ratio in rows:
        shown = f"{ratio:12.2f}" if ratio else f"{tw / value:11.0%} "
        print(f"{name:44s} {value:14.1f} {shown}")
    print(
        f"engine overhead per step (schedule+prepare+update, median): "
        f"{r['engine_overhead_ms_per_step']:.3f} ms over {r['num_steps']} steps\n"
    )


def run_overhead(args: argparse.Namespace) -> int:
    from tokenwire.runtime.llm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY_OVERHEAD_CONFIG))
        recorder = StepRecorder()
        llm = LLM(
            tmp,
            load_format="dummy",
            device="cpu",
            max_num_seqs=args.num_seqs,
            max_num_batched_tokens=max(2048, args.num_seqs * 32),
            observer=recorder,
        )
        prompts = [[(7 * i + j) % 1000 + 3 for j in range(32)] for i in range(args.num_seqs)]
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
        llm.generate(prompts, params, use_tqdm=False)
    full = [s for s in recorder.steps if s.num_seqs == args.num_seqs and s.phase == "decode"]
    result = {
        "bench": "overhead",
        "num_seqs": args.num_seqs,
        "decode_steps": len(full),
        "engine_overhead_ms_per_step": round(_overhead_ms(full), 3),
        "schedule_ms": round(1e3 * statistics.median(s.schedule_time for s in full), 3),
        "prepare_ms": round(1e3 * statistics.median(s.prepare_time for s in full), 3),
        "update_ms": round(1e3 * statistics.median(s.update_time for s in full), 3),
        "forward_ms": round(1e3 * statistics.median(s.forward_time for s in full), 3),
        "sample_ms": round(1e3 * statistics.median(s.sample_time for s in full), 3),
    }
    print(
        f"\nengine overhead with {args.num_seqs} running sequences (tiny model, median of "
        f"{len(full)} decode steps):"
    )
    for key in (
        "schedule_ms",
        "prepare_ms",
        "update_ms",
        "engine_overhead_ms_per_step",
        "forward_ms",
        "sample_ms",
    ):
        print(f"  {key:30s} {result[key]:8.3f}")
    print(json.dumps(result))
    return 0
