"""HF transformers baselines measured in the same process as tokenwire (``--compare hf``).

Sequential: one request at a time with ``generate()``. Static batching: left-padded batches
in workload order, each generating the batch's longest output for every row (that is how
static batching works); only the tokens each request asked for are counted as output.
All runs are greedy with EOS ignored (``min_new_tokens == max_new_tokens``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenwire.clients.workloads import Workload


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
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


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
    model: torch.nn.Module, workload: Workload, batch_size: int, device: torch.device
) -> HfResult:
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), batch_size):
        batch = workload.prompts[i : i + batch_size]
        _generate(model, batch, max(workload.output_lens[i : i + batch_size]), device)
    seconds = time.perf_counter() - start
    return HfResult(
        "static", batch_size, len(workload.prompts), workload.num_output_tokens, seconds
    )
