"""``tokenwire bench throughput``: the offline engine on a ``bench/workloads.py`` workload,
optionally against HF transformers (``--compare hf``) and next to the device's roofline floor.

Prints a human table, then ends with one JSON line that machines read.
Everything here takes a frozen ``ThroughputConfig``; ``bench/cli.py`` builds it from the flags.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tokenwire.bench.configs import ThroughputConfig
from tokenwire.bench.roofline import DeviceCeilings, lookup_device
from tokenwire.bench.workloads import Workload, make_workload
from tokenwire.runtime.engine_args import EngineArgs
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder, StepStats


def run_workload(llm: Any, workload: Workload) -> float:
    """Seconds the engine takes for the whole workload (greedy, EOS ignored)."""
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in workload.output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.num_output_tokens, "engine produced the wrong token count"
    return seconds


def median_ms(steps: list[StepStats], field_name: str) -> float:
    """Median of a step timing (e.g. ``collective_time``) over the run, in ms."""
    values = [getattr(s, field_name) for s in steps]
    return 1e3 * statistics.median(values) if values else float("nan")


def overhead_ms(steps: list[StepStats], num_seqs: int | None = None) -> float:
    chosen = [s for s in steps if num_seqs is None or s.num_seqs == num_seqs]
    if not chosen:
        return float("nan")
    return 1e3 * statistics.median(s.overhead_time for s in chosen)


def build_llm(engine_args: EngineArgs, recorder: StepRecorder) -> Any:
    from tokenwire.runtime.llm import LLM

    return LLM.from_engine_args(engine_args, observer=recorder)


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


def throughput_result(config: ThroughputConfig) -> dict[str, Any]:
    """Run the offline benchmark and return its JSON record."""
    recorder = StepRecorder()
    llm = build_llm(config.engine, recorder)
    engine = llm.engine
    tokenizer = llm.get_tokenizer() if config.workload == "edit" else None
    workload = make_workload(config.workload, engine.vocab_size, config.num_requests, tokenizer)
    llm.generate([workload.prompts[0]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    recorder.steps.clear()
    seconds = run_workload(llm, workload)
    result: dict[str, Any] = {
        "bench": "throughput",
        "workload": workload.name,
        "model": engine.facts.served_model_name,
        "device": engine.facts.device,
        "dtype": engine.facts.dtype,
        "tensor_parallel_size": engine.facts.tensor_parallel_size,
        "enforce_eager": config.engine.enforce_eager,
        "num_requests": len(workload.prompts),
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": workload.num_output_tokens,
        "seconds": round(seconds, 3),
        "tokenwire_output_tok_s": round(workload.num_output_tokens / seconds, 2),
        "tokenwire_total_tok_s": round(
            (workload.num_output_tokens + workload.num_prompt_tokens) / seconds, 2
        ),
        "engine_overhead_ms_per_step": round(overhead_ms(recorder.steps), 3),
        "forward_ms_per_step": round(median_ms(recorder.steps, "forward_time"), 3),
        "collective_ms_per_step": round(median_ms(recorder.steps, "collective_time"), 3),
        "num_steps": len(recorder.steps),
        "kv_blocks": engine.facts.num_blocks,
    }
    if config.tpot:
        result["tpot_batch1_ms"] = round(measure_tpot_ms(llm, recorder, config.tpot), 4)
    facts = engine.facts
    device, dtype = torch.device(facts.device), getattr(torch, facts.dtype)
    ceilings = floor_device(device, config.floor_device)
    max_seqs = config.engine.max_num_seqs
    result.update(floor_figures(facts.arch, dtype.itemsize, workload, max_seqs, ceilings))
    if config.compare == "hf":
        from tokenwire.bench.hf_baseline import compare_hf

        model_path = Path(facts.model_path)
        llm.shutdown()
        del llm, engine  # free the KV cache and graphs before HF loads its own copy
        release_device_memory(device)
        result.update(compare_hf(config.hf, model_path, device, dtype, workload))
    return result


def floor_device(device: Any, name: str | None = None) -> DeviceCeilings | None:
    """The roofline table entry: ``name`` when given, else the CUDA device's; None on CPU or
    on a device the table does not know."""
    if name is not None:
        ceilings = lookup_device(name)
        if ceilings is None:
            raise ValueError(f"--floor-device {name!r} is not in the roofline table")
        return ceilings
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    return lookup_device(torch.cuda.get_device_name(device))


def floor_figures(
    arch: Any,
    dtype_bytes: int,
    workload: Workload,
    max_num_seqs: int,
    ceilings: DeviceCeilings | None,
) -> dict[str, Any]:
    """The floor's JSON keys; the time figures are null when the device is unknown."""
    from tokenwire.bench.roofline import decode_step_floor_s, model_cost, workload_floor

    cost = model_cost(arch, dtype_bytes)
    out: dict[str, Any] = {
        "floor_device": None,
        "floor_output_tok_s": None,
        "floor_seconds": None,
        "tpot_floor_ms": None,
        "weight_bytes_per_step": cost.weight_bytes,
        # Batch 1 (the TPOT floor's): MoE reads only its active experts' bytes.
        "weight_bytes_batch1": round(cost.step_weight_bytes(1)),
        "kv_bytes_per_token": cost.kv_bytes_per_token,
    }
    if ceilings is None:
        return out
    floor = workload_floor(
        cost, [len(p) for p in workload.prompts], workload.output_lens, max_num_seqs, ceilings
    )
    out.update(
        floor_device=ceilings.name,
        floor_bandwidth_tb_s=round(ceilings.bandwidth / 1e12, 3),
        floor_bf16_tflops=round(ceilings.flops / 1e12, 1),
        floor_basis=ceilings.basis,
        floor_output_tok_s=round(floor.output_tok_s, 2),
        floor_seconds=round(floor.seconds, 4),
        tpot_floor_ms=round(1e3 * decode_step_floor_s(cost, [128], ceilings), 4),
    )
    return out


def release_device_memory(device: Any) -> None:
    import gc

    gc.collect()
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.empty_cache()


def run_throughput(config: ThroughputConfig) -> int:
    result = throughput_result(config)
    if config.compare == "hf":
        tw = result["tokenwire_output_tok_s"]
        result["ratio_vs_hf_static"] = round(tw / result["hf_static_output_tok_s"], 2)
        if result.get("hf_sequential_output_tok_s"):
            result["ratio_vs_hf_sequential"] = round(tw / result["hf_sequential_output_tok_s"], 2)
    print_table(result)
    print(json.dumps(result))
    return 0


def print_table(r: dict[str, Any]) -> None:
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
    print(
        f"\nworkload={r['workload']} model={r['model']} device={r['device']} "
        f"tensor_parallel_size={r.get('tensor_parallel_size', 1)} "
        f"dtype={r['dtype']} requests={r['num_requests']} "
        f"prompt_tokens={r['prompt_tokens']} output_tokens={r['output_tokens']}"
    )
    print(f"{'engine':44s} {'output tok/s':>14s} {'tokenwire x':>12s}")
    for name, value, ratio in rows:
        print(f"{name:44s} {value:14.1f} {ratio:12.2f}")
    if r.get("floor_output_tok_s"):
        floor = r["floor_output_tok_s"]
        name = (
            f"{r['floor_device']} floor ({r['floor_bandwidth_tb_s']:g} TB/s, "
            f"{r['floor_bf16_tflops']:g} TFLOP/s)"
        )
        print(f"{name:44s} {floor:14.1f} {tw / floor:11.0%} ")
    else:  # CPU, or a device the roofline table does not know
        print(f"{'floor (roofline ceilings of this device)':44s} {'unknown':>14s}")
    print(
        f"engine overhead per step (schedule+prepare+update, median): "
        f"{r['engine_overhead_ms_per_step']:.3f} ms over {r['num_steps']} steps"
    )
    if r.get("tensor_parallel_size", 1) > 1:
        print(
            f"per step (median): forward {r['forward_ms_per_step']:.2f} ms, of which "
            f"collectives (rank 0) {r['collective_ms_per_step']:.2f} ms"
        )
    print()
