"""Correctness anchor: greedy token ids equal HF ``generate()`` token for token (CPU float32)
for every supported family in a plain batch; for the Llama-style base families also with
prefix caching over a shared prefix, chunked prefill under a small token budget, and a KV
cache so small that preemption must happen. (Those scheduler paths do not depend on the
family; the later families' own paged-cache paths, chunked prefill and mixed decode + prefill
batches, are checked at the logits level in ``test_model_forward``.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checks import assert_llm_idle
from parity import NEW_TOKENS, distinct_prompts, hf_greedy, shared_prefix_prompts
from transformers import AutoModelForCausalLM

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder

# Engine runs over many prompts and families: in make test, not in make test-fast.
pytestmark = pytest.mark.slow

# Every scenario runs for these; the plain batch runs for every family in FAMILIES.
SCHEDULER_FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
FAMILIES = [*SCHEDULER_FAMILIES, "gemma2", "gemma3_text", "phi3"]


def run_engine(
    model_dir: Path, prompts: list[list[int]], **llm_kwargs: Any
) -> tuple[list[list[int]], LLM, StepRecorder]:
    recorder = StepRecorder()
    llm = LLM(str(model_dir), device="cpu", observer=recorder, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm, recorder


class References:
    """Per family: the tiny model's directory and HF's greedy tokens for the distinct and the
    shared-prefix prompts, each computed on first use (a ``-k`` selection builds only what
    its tests need)."""

    def __init__(self, factory: Callable[..., Path]) -> None:
        self.factory = factory
        self.cache: dict[tuple[str, str], list[list[int]]] = {}

    def distinct(self, family: str) -> tuple[Path, list[list[int]]]:
        return self._get(family, "distinct", distinct_prompts())

    def shared(self, family: str) -> tuple[Path, list[list[int]]]:
        return self._get(family, "shared", shared_prefix_prompts())

    def _get(
        self, family: str, kind: str, prompts: list[list[int]]
    ) -> tuple[Path, list[list[int]]]:
        path = self.factory(family)
        if (family, kind) not in self.cache:
            self.cache[family, kind] = hf_greedy(path, prompts)
        return path, self.cache[family, kind]


@pytest.fixture(scope="module")
def references(tiny_model_factory: Callable[..., Path]) -> References:
    return References(tiny_model_factory)


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_matches_hf(references: References, family: str) -> None:
    path, expected = references.distinct(family)
    got, llm, recorder = run_engine(path, distinct_prompts())
    assert got == expected
    assert max(s.num_seqs for s in recorder.steps) == 8  # all eight ran in one batch
    assert_llm_idle(llm)


@pytest.mark.parametrize("family", SCHEDULER_FAMILIES)
def test_prefix_caching_shared_prefix_matches_hf(references: References, family: str) -> None:
    path, expected = references.shared(family)
    recorder = StepRecorder()
    llm = LLM(str(path), device="cpu", observer=recorder)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    first = llm.generate(shared_prefix_prompts(), params, use_tqdm=False)
    second = llm.generate(shared_prefix_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in second] == expected
    # First run: prompts 2..8 share the 2 full blocks of prompt 1 (same step);
    # second run: every prompt hits its own cached blocks.
    assert sum(o.num_cached_tokens for o in first) >= 7 * 32
    assert all(o.num_cached_tokens >= 32 for o in second)
    assert_llm_idle(llm)


@pytest.mark.parametrize("family", SCHEDULER_FAMILIES)
def test_chunked_prefill_small_budget_matches_hf(references: References, family: str) -> None:
    path, expected = references.distinct(family)
    got, llm, recorder = run_engine(
        path, distinct_prompts(), max_num_batched_tokens=16, enable_prefix_caching=False
    )
    assert got == expected
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= 16 for s in recorder.steps)
    assert any(s.phase == "mixed" for s in recorder.steps)
    assert_llm_idle(llm)


@pytest.mark.parametrize("family", SCHEDULER_FAMILIES)
def test_tiny_kv_cache_preempts_and_matches_hf(references: References, family: str) -> None:
    path, expected = references.distinct(family)
    # 12 usable blocks of 16 tokens = 192 slots for 8 sequences that grow to ~100 tokens.
    got, llm, recorder = run_engine(
        path, distinct_prompts(), num_gpu_blocks_override=13, max_model_len=128
    )
    assert got == expected
    assert sum(s.num_preemptions for s in recorder.steps) > 0
    assert sum(r.num_preemptions for r in recorder.requests) > 0
    assert_llm_idle(llm)


# Windows far shorter than the prompts (5..68 tokens) plus 32 generated tokens, so decodes,
# prefill chunks and prefix hits all reach past the window; Gemma alternates windowed and
# global layers, Qwen2 windows only its layers from max_window_layers on.
WINDOWED = {
    "mistral": {"sliding_window": 12},
    "gemma2": {"sliding_window": 12},
    "gemma3_text": {"sliding_window": 12},
    "phi3": {"sliding_window": 12},
    "qwen2": {"sliding_window": 12, "use_sliding_window": True, "max_window_layers": 1},
}


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_sliding_window_past_the_window_matches_hf(
    tiny_model_factory: Callable[..., Path], family: str
) -> None:
    """Served past its window (max_model_len is the model's, not the window), a windowed
    model equals HF in one batch and with chunked prefill over cached prefixes."""
    path = tiny_model_factory(family, **WINDOWED[family])
    prompts = distinct_prompts()
    expected = hf_greedy(path, prompts)
    got, llm, _ = run_engine(path, prompts)
    assert got == expected
    assert llm.engine.max_model_len == 512
    assert_llm_idle(llm)
    chunked, llm, recorder = run_engine(path, prompts + prompts[:2], max_num_batched_tokens=16)
    assert chunked == expected + expected[:2]
    assert any(s.phase == "mixed" for s in recorder.steps)
    assert_llm_idle(llm)


def test_sliding_window_request_outgrows_a_cache_of_one_window(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """Every Mistral layer is windowed, so blocks behind the window are freed: a 40 + 150
    token request runs in a KV cache of 4 blocks (64 tokens) without preemption and equals HF."""
    path = tiny_model_factory("mistral", **WINDOWED["mistral"])
    prompt = distinct_prompts()[4][:40]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=150, do_sample=False)
    recorder = StepRecorder()
    llm = LLM(
        str(path), device="cpu", observer=recorder, num_gpu_blocks_override=5,
        max_num_batched_tokens=16,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == ids[0, len(prompt) :].tolist()
    assert sum(s.num_preemptions for s in recorder.steps) == 0
    assert_llm_idle(llm)
