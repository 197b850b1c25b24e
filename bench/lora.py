"""``tokenwire bench lora``: offline throughput with ``N`` LoRA adapters mixed evenly over the
requests, against the base model alone, in the same run (issue 15's figure).

Three passes over the same workload, each on a fresh engine:

1. ``base``: LoRA not enabled (what the model runs without adapters);
2. ``lora_mixed``: ``--enable-lora --max-loras N`` with N random adapters (rank ``R``,
   every projection targeted), request ``i`` using adapter ``i % N``;
3. ``lora_base_only``: the same LoRA engine, every request on the base model (what merely
   enabling LoRA costs).

The adapters are random PEFT-format directories written here for the model's shapes (no
``peft`` needed). Prints a table, then one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tokenwire.bench.configs import LoRABenchConfig
from tokenwire.bench.workloads import Workload, make_workload
from tokenwire.runtime.lora.adapter import (
    CONFIG_FILE,
    TARGET_MODULES,
    WEIGHTS_FILE,
    projection_shape,
)
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.sampling_params import SamplingParams


def write_random_adapter(arch: ModelArch, out_dir: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory for ``arch`` targeting every projection (small random B)."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(arch.num_hidden_layers):
        for module, block in TARGET_MODULES.items():
            out_f, in_f = projection_shape(arch, module)
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            a = torch.randn(rank, in_f, generator=generator) / in_f**0.5
            b = torch.randn(out_f, rank, generator=generator) * 0.01
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted(TARGET_MODULES),
        "bias": "none",
    }
    (out_dir / CONFIG_FILE).write_text(json.dumps(config))
    return out_dir


def _timed_pass(llm: Any, workload: Workload, loras: list[LoRARequest | None]) -> float:
    """Seconds for the whole workload (greedy, EOS ignored) after a warm-up on its first
    eight requests (every adapter of the pass, batch shapes of the timed run)."""
    warm = SamplingParams(max_tokens=16, ignore_eos=True)
    llm.generate(workload.prompts[:8], warm, use_tqdm=False, lora_request=loras[:8])
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in workload.output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.num_output_tokens, "engine produced the wrong token count"
    return seconds


def lora_result(config: LoRABenchConfig) -> dict[str, Any]:
    from tokenwire.runtime.llm import LLM

    base_llm = LLM.from_engine_args(config.engine)
    engine = base_llm.engine
    arch, facts = engine.facts.arch, engine.facts
    workload = make_workload(config.workload, engine.vocab_size, config.num_requests)
    n = len(workload.prompts)
    base_s = _timed_pass(base_llm, workload, [None] * n)
    base_llm.shutdown()
    del base_llm, engine
    with tempfile.TemporaryDirectory(prefix="tokenwire-lora-bench-") as tmp:
        modules = tuple(
            (f"adapter{i}", str(write_random_adapter(arch, Path(tmp) / f"a{i}", config.rank, i)))
            for i in range(config.num_adapters)
        )
        lora_args = dataclasses.replace(
            config.engine,
            enable_lora=True,
            lora_modules=modules,
            max_loras=config.num_adapters,
            max_lora_rank=config.rank,
        )
        llm = LLM.from_engine_args(lora_args)
        adapters = [llm.engine.get_lora(name) for name, _ in modules]
        mixed_s = _timed_pass(llm, workload, [adapters[i % len(adapters)] for i in range(n)])
        base_only_s = _timed_pass(llm, workload, [None] * n)
        llm.shutdown()
    out_tokens = workload.num_output_tokens
    return {
        "bench": "lora",
        "workload": workload.name,
        "model": facts.served_model_name,
        "device": facts.device,
        "dtype": facts.dtype,
        "quantization": facts.quantization or "",
        "num_requests": n,
        "output_tokens": out_tokens,
        "num_adapters": config.num_adapters,
        "lora_rank": config.rank,
        "base_output_tok_s": round(out_tokens / base_s, 2),
        "lora_mixed_output_tok_s": round(out_tokens / mixed_s, 2),
        "lora_base_only_output_tok_s": round(out_tokens / base_only_s, 2),
        "lora_mixed_vs_base": round(base_s / mixed_s, 3),
        "lora_base_only_vs_base": round(base_s / base_only_s, 3),
    }


def run_lora_bench(config: LoRABenchConfig) -> int:
    r = lora_result(config)
    print(f"{'pass':<34}{'output tok/s':>14}{'vs base':>10}")
    print(f"{'base model, LoRA not enabled':<34}{r['base_output_tok_s']:>14.2f}{1.0:>10.3f}")
    label = f"{r['num_adapters']} adapters (rank {r['lora_rank']}) mixed"
    print(f"{label:<34}{r['lora_mixed_output_tok_s']:>14.2f}{r['lora_mixed_vs_base']:>10.3f}")
    label = "LoRA enabled, base requests only"
    print(
        f"{label:<34}{r['lora_base_only_output_tok_s']:>14.2f}{r['lora_base_only_vs_base']:>10.3f}"
    )
    print(json.dumps(r))
    return 0
