"""``--cpu-compile``: the CPU forward as one inductor graph, attention eager (worker.cpu_compile).

HF parity on a tiny float32 model with the compiled forward (prefills, chunked prefills,
one-row and many-row decode steps all through the one dynamic graph); the default model's
fast path stays batch-invariant compiled; a compile that fails falls back to eager with a log
line; where the compiled forward cannot apply it is not applied, and said so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from parity import distinct_prompts, hf_greedy
from tiny_models import build_tiny_model

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.worker.cpu_compile import CompiledCpuForward, cpu_compile_blocker

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def _runner(llm: LLM) -> Any:
    return llm.engine.executor.worker.runner  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_compiled_forward_equals_hf_generate(tiny_llama: Path, async_scheduling: bool) -> None:
    """Chunked prefill (16-token budget) and a batch of 8 make every step shape: one-row
    decodes, many-row decodes, prefill chunks, mixed steps; with async scheduling too."""
    llm = LLM(
        str(tiny_llama), cpu_compile=True, device="cpu", async_scheduling=async_scheduling,
        max_num_batched_tokens=16, max_model_len=128,
    )  # fmt: skip
    compiled = _runner(llm)._compiled
    assert isinstance(compiled, CompiledCpuForward)
    prompts = distinct_prompts()
    alone = llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert not compiled.failed
    expected = hf_greedy(tiny_llama, prompts)
    assert list(alone) == expected[0]
    assert [list(t) for t in batch] == expected


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_default_model_compiled_alone_equals_inside_a_batch_of_16() -> None:
    """The fast path (int4 linears, bf16 head) compiled, at the default two threads."""
    llm = LLM(None, device="cpu", max_model_len=512, cpu_compile=True)
    compiled = _runner(llm)._compiled
    assert isinstance(compiled, CompiledCpuForward)
    prompts = [[100 + (7 * i + 13 * j) % 20000 for j in range(24 + 5 * i)] for i in range(16)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    for i in (0, 7, 15):
        alone = llm.generate([prompts[i]], greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert alone == batch[i], f"prompt {i} alone differs from inside the batch of 16"
    assert not compiled.failed


def _failing_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
    raise RuntimeError("no compiler here")


def test_a_failing_compile_falls_back_to_eager_with_a_log_line(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    llm = LLM(str(tiny_llama), device="cpu", max_model_len=128)
    runner = _runner(llm)
    prompts = distinct_prompts()[:3]
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    compiled = CompiledCpuForward(runner.model, runner.kv_cache.layers, backend=_failing_backend)
    runner._compiled = compiled
    with caplog.at_level(logging.WARNING, logger="tokenwire.worker"):
        compiled.warm_up(runner.inputs)
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert compiled.failed
    assert again == eager
    assert any("cpu compile failed" in r.getMessage() for r in caplog.records)
    assert any("steps run eagerly" in r.getMessage() for r in caplog.records)


def test_where_the_compiled_forward_does_not_apply(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), device="cpu", max_model_len=128)
    model = _runner(llm).model
    cpu = torch.device("cpu")
    assert cpu_compile_blocker(model, cpu, lora=False) is None
    assert "LoRA" in (cpu_compile_blocker(model, cpu, lora=True) or "")
    assert "CPU" in (cpu_compile_blocker(model, torch.device("cuda"), lora=False) or "")
    assert "no compiled forward" in (cpu_compile_blocker(torch.nn.Linear(2, 2), cpu, False) or "")


def test_compile_is_off_by_default(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), device="cpu", max_model_len=128)
    assert _runner(llm)._compiled is None
