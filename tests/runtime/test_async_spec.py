"""Async scheduling with speculative decoding (n-gram and draft model): greedy and seeded
outputs equal synchronous scheduling's token for token (n > 1, penalties, stop tokens,
max_tokens, chunked prefill, preemption), each step after a sampling step runs while the
caller handles the outputs before it, prefill chunks are planned while the step ahead runs,
and aborts mid-speculation leave every KV block free."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_checks import assert_llm_idle
from spec_runs import PROMPTS, copying_model
from step_overlap import overlapped, run_aborting_b, steps_of

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder

# Engine runs over several features and both proposers: in make test, not in make test-fast.
pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


FEATURES: dict[str, tuple[SamplingParams | list[SamplingParams], dict[str, Any]]] = {
    "greedy": (greedy(max_tokens=24), {}),
    "max_tokens_each": ([greedy(max_tokens=m) for m in (1, 5, 17)], {}),
    "seeded": (
        [SamplingParams(temperature=0.9, top_k=40, seed=i, max_tokens=20) for i in range(3)],
        {},
    ),
    "n_2_seeded": (SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12), {}),
    "penalties": (
        greedy(
            max_tokens=20, presence_penalty=0.05, frequency_penalty=0.05, repetition_penalty=1.02
        ),
        {},
    ),
    "chunked_prefill": (greedy(max_tokens=16), {"max_num_batched_tokens": 8}),
    "preemption": (
        greedy(max_tokens=40, ignore_eos=True),
        {"max_model_len": 128, "num_gpu_blocks_override": 10, "block_size": 16},
    ),
    # Preempted while prefill chunks (planned ahead) and verify steps are in flight.
    "chunked_preemption": (
        greedy(max_tokens=60, ignore_eos=True),
        {
            "max_model_len": 112,
            "num_gpu_blocks_override": 29,
            "block_size": 4,
            "max_num_batched_tokens": 8,
        },
    ),
}


# Long enough for the copying model's greedy output to cycle: drafts get accepted.
GREEDY_CYCLES = ("greedy", "chunked_prefill", "preemption", "chunked_preemption")


def spec_config(method: str, model: Path) -> dict[str, Any]:
    if method == "ngram":
        return NGRAM
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}


@pytest.fixture
def model(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> Path:
    """A model whose greedy output soon cycles: prompt lookup drafts get accepted."""
    return copying_model(tiny_model_factory("llama"), tmp_path / "copying")


def run(
    model: Path,
    method: str,
    params: SamplingParams | list[SamplingParams],
    async_scheduling: bool,
    **kwargs: Any,
) -> tuple[list[list[list[int]]], LLM, StepRecorder, int]:
    """Each prompt's choices, the engine, its steps, and how many ``step()`` calls returned
    tokens while the next step was already in flight (stepped by hand, as the core loop)."""
    recorder = StepRecorder()
    llm = LLM(
        str(model),
        device="cpu",
        observer=recorder,
        async_scheduling=async_scheduling,
        speculative_config=spec_config(method, model),
        **kwargs,
    )
    engine = llm.engine
    plist = params if isinstance(params, list) else [params] * len(PROMPTS)
    tokens: dict[str, list[int]] = {}
    for i, (prompt, p) in enumerate(zip(PROMPTS, plist, strict=True)):
        for c in range(p.n):  # n > 1: seeded children, as the front fans them out
            child = p if p.n == 1 else p.with_seed((p.seed or 0) + c)
            engine.add_request(f"{i}-{c}", prompt, child)
            tokens[f"{i}-{c}"] = []
    ahead = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for output in outputs:
            tokens[output.request_id].extend(output.new_token_ids)
        ahead += bool(outputs) and engine.step_in_flight
    choices = [[tokens[f"{i}-{c}"] for c in range(p.n)] for i, p in enumerate(plist)]
    assert_llm_idle(llm)
    return choices, llm, recorder, ahead


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_async_speculation_equals_sync(model: Path, method: str, feature: str) -> None:
    params, kwargs = FEATURES[feature]
    sync, _, sync_rec, sync_ahead = run(model, method, params, False, **kwargs)
    fast, _, rec, ahead = run(model, method, params, True, **kwargs)
    assert fast == sync
    # The same drafts were made and accepted as under synchronous steps.
    assert rec.drafted == sync_rec.drafted > 0 and rec.accepted == sync_rec.accepted
    if feature in GREEDY_CYCLES:
        assert rec.accepted > 0
    assert sync_ahead == 0 and ahead > 0
    if feature.startswith("chunked"):  # prefill chunks sample nothing: planned ahead
        assert overlapped(rec.steps) and not overlapped(sync_rec.steps)
    if feature.endswith("preemption"):
        assert sum(s.num_preemptions for s in rec.steps) > 0


def spec_llm(model: Path, method: str, async_scheduling: bool, **kwargs: Any) -> LLM:
    return LLM(
        str(model),
        device="cpu",
        observer=StepRecorder(),
        async_scheduling=async_scheduling,
        speculative_config=spec_config(method, model),
        **kwargs,
    )


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_abort_mid_speculation(model: Path, method: str) -> None:
    """ "b" is aborted while a verify step that drafted for it is in flight: the others' tokens
    equal synchronous steps', "b" got a prefix of its tokens, and every block is free."""
    params = greedy(max_tokens=24, ignore_eos=True)
    got = {}
    for async_scheduling in (False, True):
        llm = spec_llm(model, method, async_scheduling)
        got[async_scheduling] = run_aborting_b(llm, PROMPTS, params, abort_at=4)
        assert steps_of(llm).drafted > 0
        assert_llm_idle(llm)
    sync, fast = got[False], got[True]
    assert fast["a"] == sync["a"] and fast["c"] == sync["c"] and len(sync["a"]) == 24
    assert 0 < len(fast["b"]) < 24 and fast["b"] == sync["b"][: len(fast["b"])]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_abort_everything_in_flight_frees_every_block(model: Path, method: str) -> None:
    """Aborting every request while a step is in flight, once drafts were accepted, drains
    it: the engine is idle at once, every block free, and it serves again as before."""
    llm = spec_llm(model, method, True)
    engine, recorder = llm.engine, steps_of(llm)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt * 2, greedy(max_tokens=60))
    while recorder.accepted == 0 or not engine.step_in_flight:
        engine.step()
    assert engine.scheduler.running  # the step in flight verifies their drafts
    engine.abort_requests([str(i) for i in range(len(PROMPTS))])
    assert_llm_idle(llm)
    again = llm.generate(PROMPTS[:1], greedy(max_tokens=12), use_tqdm=False)
    sync = spec_llm(model, method, False).generate(PROMPTS[:1], greedy(max_tokens=12))
    assert again[0].outputs[0].token_ids == sync[0].outputs[0].token_ids
    assert_llm_idle(llm)


def test_structured_outputs_with_speculation(
    tiny_model_with_tokenizer: Path, tmp_path: Path
) -> None:
    """Constrained requests speculate under async steps too (n-gram drafts cut to the
    grammar, per-position masks): greedy and seeded outputs equal synchronous steps', drafts
    get accepted, and a chunked prefill beside them is planned ahead."""
    from tokenwire.runtime.sampling_params import StructuredOutputsParams

    model = copying_model(tiny_model_with_tokenizer, tmp_path / "copying")
    regex = StructuredOutputsParams(regex=r"[ab]{30,90}\.")
    params = [
        greedy(max_tokens=48, structured_outputs=regex),
        SamplingParams(temperature=0.9, seed=3, max_tokens=48, structured_outputs=regex),
        greedy(max_tokens=20),
    ]
    results = []
    for async_scheduling in (False, True):
        llm = spec_llm(model, "ngram", async_scheduling, max_num_batched_tokens=16)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outputs])
        recorder = steps_of(llm)
        assert recorder.accepted > 0
        assert overlapped(recorder.steps) == async_scheduling
        assert_llm_idle(llm)
    assert results[0] == results[1]


def test_tensor_parallel_speculation(model: Path) -> None:
    """TP=2 (gloo worker processes): async steps with n-gram speculation equal synchronous
    TP=1 steps' greedy and seeded tokens."""
    params = [
        greedy(max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=20),
        greedy(max_tokens=12),
    ]
    sync = spec_llm(model, "ngram", False).generate(PROMPTS, params, use_tqdm=False)
    llm = spec_llm(model, "ngram", True, tensor_parallel_size=2)
    try:
        fast = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in sync]
        assert steps_of(llm).accepted > 0
        assert_llm_idle(llm)
    finally:
        llm.shutdown()
