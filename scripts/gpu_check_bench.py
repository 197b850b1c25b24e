"""The offline bench stages of ``gpu_check_stages.py`` (``bench``, ``lora``, ``spec``), run
from there in the stage's own process: throughput of the named workloads and batch-1 TPOT
(with their roofline floors; ``--hf``: the HF static baseline), LoRA's mixed-adapter cost,
and n-gram speculation over plain decoding. Every engine uses dummy weights of ``--model``
at the bench engine settings (``BENCH_MAX_MODEL_LEN``, ``BENCH_BATCHED_TOKENS``) shared with
the served bench.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpu_check_stages import BENCH_BATCHED_TOKENS, BENCH_MAX_MODEL_LEN, Recorder, device_name

if TYPE_CHECKING:
    from tokenwire.bench.configs import LoRABenchConfig, ThroughputConfig


def _bench_config(args: argparse.Namespace) -> ThroughputConfig:
    """Dummy weights of ``--model``; ``--quantization`` (fp8: online, gptq/awq: random 4-bit
    codes) and ``--kv-cache-dtype`` pass through to the engine (issue 13's stages)."""
    from tokenwire.bench.configs import ThroughputConfig
    from tokenwire.runtime.engine_args import EngineArgs

    engine = EngineArgs(
        model=args.model, load_format="dummy", device=device_name(args.smoke),
        dtype="float32" if args.smoke else "bfloat16", max_model_len=BENCH_MAX_MODEL_LEN,
        max_num_batched_tokens=BENCH_BATCHED_TOKENS, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, async_scheduling=args.async_scheduling,
    )  # fmt: skip
    return ThroughputConfig(engine=engine)


def _workload(name: str, vocab: int, smoke: bool) -> Any:
    """The named workload; for --smoke its first 2 requests cut to 24 prompt + 8 output tokens."""
    from tokenwire.bench.workloads import Workload, make_workload

    w = make_workload(name, vocab, 2 if smoke else None)
    if not smoke:
        return w
    return Workload(w.name, [p[:24] for p in w.prompts], [min(o, 8) for o in w.output_lens])


def _timed_workload(llm: Any, workload: Any) -> float:
    from tokenwire.bench.throughput import run_workload

    return run_workload(llm, workload)


def stage_bench(args: argparse.Namespace, record: Recorder) -> None:
    import torch

    from tokenwire.bench.throughput import (
        build_llm,
        floor_device,
        floor_figures,
        measure_tpot_ms,
        release_device_memory,
    )
    from tokenwire.runtime.sampling_params import SamplingParams
    from tokenwire.runtime.stats import StepRecorder

    config = _bench_config(args)
    label = args.label or args.model
    steps = StepRecorder()
    start = time.perf_counter()
    llm = build_llm(config.engine, steps)
    engine = llm.engine
    record(kind="startup", model=label, seconds=round(time.perf_counter() - start, 2),
           kv_blocks=engine.facts.num_blocks)  # fmt: skip
    facts = engine.facts
    device, dtype = torch.device(facts.device), getattr(torch, facts.dtype)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    # Floors assume weights in the model dtype: none for quantized weights.
    floor: dict[str, Any] = {"floor_output_tok_s": None, "tpot_floor_ms": None}
    for name in ([] if args.tpot_only else ["mixed"]) + (["fixed"] if args.hf else []):
        workload = _workload(name, engine.vocab_size, args.smoke)
        seconds = _timed_workload(llm, workload)
        # The floor of the device it runs on (H200: issue 6's); null on the CPU (--smoke).
        ceilings = floor_device(device)
        if not args.quantization:
            floor = floor_figures(facts.arch, dtype.itemsize, workload,
                                  config.engine.max_num_seqs, ceilings)  # fmt: skip
        record(kind="throughput", model=label, workload=name,
               output_tokens=workload.num_output_tokens, seconds=round(seconds, 3),
               output_tok_s=round(workload.num_output_tokens / seconds, 1),
               floor_output_tok_s=floor["floor_output_tok_s"])  # fmt: skip
    tpot = measure_tpot_ms(llm, steps, 16 if args.smoke else 256)
    record(kind="tpot", model=label, tpot_ms=round(tpot, 4),
           tpot_floor_ms=floor["tpot_floor_ms"],
           weight_bytes_batch1=floor.get("weight_bytes_batch1"))  # fmt: skip
    if args.hf:
        model_path, vocab = Path(facts.model_path), engine.vocab_size
        llm.shutdown()
        del llm, engine
        release_device_memory(device)
        _hf_static(args, model_path, device, dtype, vocab, record)


def stage_lora(args: argparse.Namespace, record: Recorder) -> None:
    """Issue 15: output tok/s with 4 random rank-16 adapters mixed evenly vs the base alone
    (LoRA not enabled), and with LoRA enabled but base requests only; dummy weights. Issue 34
    item 4: the same mixed pass on an ``enforce_eager`` engine, so LoRA's decode graphs are
    measured against eager in the same run (``lora_graphs``)."""
    import dataclasses

    from tokenwire.bench.configs import LoRABenchConfig
    from tokenwire.bench.lora import lora_result

    engine = dataclasses.replace(_bench_config(args).engine, max_num_batched_tokens=4096)
    # --smoke: 2 ``short`` requests (64 output tokens each), leaving the graph/eager passes
    # room under the stage's cap on a busy CPU.
    workload, requests = ("short", 2) if args.smoke else ("fixed", 128)
    config = LoRABenchConfig(engine=engine, workload=workload, num_requests=requests)
    r = lora_result(config)
    model = args.label or args.model
    record(kind="lora", model=model, workload=r["workload"],
           num_requests=r["num_requests"], base_output_tok_s=r["base_output_tok_s"],
           lora_mixed_output_tok_s=r["lora_mixed_output_tok_s"],
           lora_base_only_output_tok_s=r["lora_base_only_output_tok_s"],
           ratio=r["lora_mixed_vs_base"])  # fmt: skip
    # --smoke (CPU, no graphs either way): both passes on the cut workload, so the stage
    # stays well under its cap; on a GPU the graphs figure is the mixed pass above.
    graphs = r["lora_mixed_output_tok_s"]
    if args.smoke:
        graphs = _lora_mixed_tok_s(config, enforce_eager=False, smoke=True)
    eager = _lora_mixed_tok_s(config, enforce_eager=True, smoke=args.smoke)
    record(kind="lora_graphs", model=model, graphs_mixed_output_tok_s=graphs,
           eager_mixed_output_tok_s=eager, ratio=round(graphs / eager, 3))  # fmt: skip


def _lora_mixed_tok_s(config: LoRABenchConfig, *, enforce_eager: bool, smoke: bool) -> float:
    """Output tok/s of ``bench lora``'s mixed pass (its adapters, its timing) on a fresh
    LoRA engine, with or without decode CUDA graphs (``enforce_eager``); ``smoke``: over
    the cut workload of ``_workload``."""
    import dataclasses
    import tempfile

    from tokenwire.bench.lora import _timed_pass, write_random_adapter
    from tokenwire.bench.workloads import make_workload
    from tokenwire.runtime.llm import LLM

    n_adapters = config.num_adapters
    engine = dataclasses.replace(
        config.engine, enforce_eager=enforce_eager, enable_lora=True, max_loras=n_adapters,
        max_lora_rank=config.rank,
    )  # fmt: skip
    llm = LLM.from_engine_args(engine)
    core = llm.engine
    workload = (
        _workload(config.workload, core.vocab_size, True)
        if smoke
        else make_workload(config.workload, core.vocab_size, config.num_requests)
    )
    with tempfile.TemporaryDirectory(prefix="tokenwire-lora-eager-") as tmp:
        adapters = [
            core.add_lora(f"adapter{i}", str(write_random_adapter(
                core.facts.arch, Path(tmp) / f"a{i}", config.rank, i)))
            for i in range(n_adapters)
        ]  # fmt: skip
        n = len(workload.prompts)
        seconds = _timed_pass(llm, workload, [adapters[i % n_adapters] for i in range(n)])
    llm.shutdown()
    return round(workload.num_output_tokens / seconds, 2)


def stage_spec(args: argparse.Namespace, record: Recorder) -> None:
    """Issue 16: output tok/s with n-gram speculation (k = 3) over plain decoding, one stream
    (requests one at a time) and 64 at once, on the ``repeat`` workload. Dummy weights never
    copy, so every ``o_proj`` and ``down_proj`` is zeroed after loading (a "copying" model:
    the next token depends on the current one only, greedy text soon cycles and drafts get
    accepted) — the verify step's cost at a high acceptance rate, not a real model's rate.
    Issue 34: the n-gram engine runs each stream count twice, with its verify CUDA graphs
    (``ngram``) and with them set aside (``ngram+eager``: verify steps run eagerly, decode
    graphs stay), so the verify graphs are measured against eager in the same run and engine.
    (A third engine with ``enforce_eager`` would not fit the smoke stage's cap and would also
    drop the decode graphs of the steps without drafts.)"""
    import dataclasses

    import torch

    from tokenwire.bench.throughput import build_llm, release_device_memory
    from tokenwire.runtime.config import SpeculativeConfig
    from tokenwire.runtime.sampling_params import SamplingParams
    from tokenwire.runtime.stats import StepRecorder

    ngram = SpeculativeConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=4)
    base = _bench_config(args).engine
    for spec in (None, ngram):
        steps = StepRecorder()
        llm = build_llm(dataclasses.replace(base, speculative_config=spec), steps)
        _zero_residual_writes(llm)
        engine = llm.engine
        w = _workload("repeat", engine.vocab_size, args.smoke)
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=w.output_lens[0])
        llm.generate(w.prompts[:1], params, use_tqdm=False)  # warm-up
        variants = [("ngram", True), ("ngram+eager", False)] if spec else [("plain", True)]
        for streams in (1, 2 if args.smoke else 64):
            prompts = (w.prompts * streams)[: max(streams, len(w.prompts))]
            for method, graphs in variants:
                _set_verify_graphs(llm, graphs)
                steps.steps.clear()
                start = time.perf_counter()
                batches = [[p] for p in prompts] if streams == 1 else [prompts]
                for batch in batches:
                    llm.generate(batch, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = len(prompts) * w.output_lens[0]
                record(kind="spec", model=args.label or args.model, method=method,
                       streams=streams, output_tok_s=round(tokens / seconds, 1),
                       draft_tokens=sum(s.num_draft_tokens for s in steps.steps),
                       accepted_tokens=sum(s.num_accepted_tokens for s in steps.steps))  # fmt: skip
        device = engine.facts.device
        llm.shutdown()
        del llm, engine
        release_device_memory(torch.device(device))


def _set_verify_graphs(llm: Any, on: bool) -> None:
    """Replay the CUDA runner's verify graphs (``on``) or run verify steps eagerly; the
    captured graphs are kept aside on the runner. No CUDA runner (CPU): nothing to switch."""
    cuda = llm.engine.executor.worker.runner._cuda
    if cuda is None:
        return
    if not hasattr(cuda, "verify_captured"):
        cuda.verify_captured = cuda.verify
    cuda.verify = cuda.verify_captured if on else None


def _zero_residual_writes(llm: Any) -> None:
    """Zero every layer's ``o_proj`` and ``down_proj`` weights in place (CUDA graphs keep
    their pointers): attention and MLP still run, but add nothing to the residual stream."""
    import torch

    model = llm.engine.executor.worker.runner.model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()


def _hf_static(
    args: argparse.Namespace, model_path: Path, device: Any, dtype: Any, vocab: int,
    record: Recorder,
) -> None:  # fmt: skip
    from tokenwire.bench.hf_baseline import load_hf_model, run_static

    workload = _workload("fixed", vocab, args.smoke)
    model = load_hf_model(model_path, device, dtype)
    result = run_static(model, workload, 2 if args.smoke else 256, device, args.hf_requests)
    record(kind="hf_static", model=args.model, workload="fixed", batch=result.batch_size,
           requests=result.num_requests, output_tok_s=round(result.output_tok_s, 1))  # fmt: skip
