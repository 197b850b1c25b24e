"""HF transformers baselines measured in the same process as tokenwire (``--compare hf``).

Sequential: one request at a time with ``generate()``. Static batching: left-padded batches
in workload order, each generating the batch's longest output for every row (that is how
static batching works); only the tokens each request asked for are counted as output.
All runs are greedy with EOS ignored (``min_new_tokens == max_new_tokens``). A directory
without weights (``--load-format dummy``: a bundled config) gets HF's own random init, built
directly on the device; random weights do not change the cost of a forward pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenwire.bench.configs import HfBaselineConfig
from tokenwire.bench.workloads import Workload


@dataclass(frozen=True)
class HfResult:
    mode: str
    batch_size: int
    num_requests: int
    output_tokens: int
    seconds: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds


def load_hf_model(model_dir: Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    model: torch.nn.Module
    if any(model_dir.glob("*.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    else:
        config = AutoConfig.from_pretrained(model_dir)
        with device:  # random init on the device itself (an 8B init on the host takes minutes)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


def compare_hf(
    config: HfBaselineConfig,
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    workload: Workload,
) -> dict[str, Any]:
    """HF baselines for ``--compare hf``: best static batch, and one at a time unless
    ``sequential_requests`` is 0. ``num_requests`` bounds the static runs."""
    model = load_hf_model(model_dir, device, dtype)
    statics = [
        run_static(model, workload, b, device, config.num_requests) for b in config.batch_sizes
    ]
    best = max(statics, key=lambda r: r.output_tok_s)
    out: dict[str, Any] = {
        "hf_static_output_tok_s": round(best.output_tok_s, 2),
        "hf_static_best_batch": best.batch_size,
        "hf_static_requests": best.num_requests,
        "hf_static_by_batch": {str(r.batch_size): round(r.output_tok_s, 2) for r in statics},
    }
    if config.sequential_requests > 0:
        seq = run_sequential(model, workload, config.sequential_requests, device)
        out["hf_sequential_output_tok_s"] = round(seq.output_tok_s, 2)
        out["hf_sequential_requests"] = seq.num_requests
    return out


def _generate(
    model: torch.nn.Module, batch: list[list[int]], new_tokens: int, device: torch.device
) -> None:
    width = max(len(p) for p in batch)
    pad = 0
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):  # left padding, as HF recommends for decoder-only models
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        model.generate(  # type: ignore[operator]
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
        )


def run_sequential(
    model: torch.nn.Module, workload: Workload, num_requests: int, device: torch.device
) -> HfResult:
    n = min(num_requests, len(workload.prompts))
    start = time.perf_counter()
    for prompt, out_len in zip(workload.prompts[:n], workload.output_lens[:n], strict=True):
        _generate(model, [prompt], out_len, device)
    seconds = time.perf_counter() - start
    return HfResult("sequential", 1, n, sum(workload.output_lens[:n]), seconds)


def run_static(
    model: torch.nn.Module,
    workload: Workload,
    batch_size: int,
    device: torch.device,
    num_requests: int | None = None,
) -> HfResult:
    """Static batches over the first ``num_requests`` requests (default: all)."""
    n = len(workload.prompts) if num_requests is None else min(num_requests, len(workload.prompts))
    _generate(model, [workload.prompts[0][:8]], 2, device)  # warm-up: kernels, allocator
    _sync(device)
    start = time.perf_counter()
    for i in range(0, n, batch_size):
        j = min(i + batch_size, n)
        _generate(model, workload.prompts[i:j], max(workload.output_lens[i:j]), device)
    _sync(device)
    seconds = time.perf_counter() - start
    return HfResult("static", batch_size, n, sum(workload.output_lens[:n]), seconds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
