"""Async scheduling (``--async-scheduling``): the engine plans step k+1 while step k runs, and
its greedy and seeded outputs equal synchronous scheduling's token for token, for every
feature it covers (stop tokens and strings, max_tokens, min_tokens, n > 1, penalties,
logprobs, chunked prefill, preemption, aborts). What it does not cover runs synchronous
steps with the same output. After every run the engine is idle with every KV block free."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_checks import assert_llm_idle

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder, StepStats

# Engine runs over several prompts and features: in make test, not in make test-fast.
pytestmark = pytest.mark.slow

PROMPTS: list[list[int]] = [
    [5, 6, 7, 8, 9],
    list(range(20, 61)),
    [11, 12, 13, 11, 12, 13, 11],
    [300, 301],
    list(range(100, 127)),
]

Run = tuple[list[list[list[int]]], LLM, StepRecorder]


def generate(
    model: Path,
    params: SamplingParams | list[SamplingParams],
    async_scheduling: bool,
    prompts: list[list[int]] = PROMPTS,
    **kwargs: Any,
) -> Run:
    recorder = StepRecorder()
    llm = LLM(
        str(model), device="cpu", observer=recorder, async_scheduling=async_scheduling, **kwargs
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_llm_idle(llm)
    return [[c.token_ids for c in o.outputs] for o in outputs], llm, recorder


def overlapped(steps: list[StepStats]) -> bool:
    """Whether some step was planned before the step ahead of it was reconciled."""
    ordered = sorted(steps, key=lambda s: s.step_id)
    return any(
        later.started_at_ns < earlier.started_at_ns + earlier.duration * 1e9
        for earlier, later in itertools.pairwise(ordered)
    )


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


FEATURES: dict[str, tuple[SamplingParams | list[SamplingParams], dict[str, Any]]] = {
    "greedy": (greedy(max_tokens=24), {}),
    "max_tokens_each": ([greedy(max_tokens=m) for m in (1, 2, 5, 17, 3)], {}),
    "seeded": (
        [SamplingParams(temperature=0.9, top_k=40, seed=i, max_tokens=20) for i in range(5)],
        {},
    ),
    "n_3_seeded": (SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12), {}),
    "penalties": (
        greedy(max_tokens=20, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
        {},
    ),
    "min_tokens": (greedy(max_tokens=20, min_tokens=6), {}),
    "chunked_prefill": (greedy(max_tokens=16), {"max_num_batched_tokens": 16}),
    "preemption": (
        greedy(max_tokens=40, ignore_eos=True),
        {"max_model_len": 128, "num_gpu_blocks_override": 10, "block_size": 16},
    ),
    "context_window": (greedy(max_tokens=None, ignore_eos=True), {"max_model_len": 64}),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_async_equals_sync(tiny_model_factory: Callable[..., Path], feature: str) -> None:
    model = tiny_model_factory("llama")
    params, kwargs = FEATURES[feature]
    sync, _, sync_rec = generate(model, params, False, **kwargs)
    fast, _, async_rec = generate(model, params, True, **kwargs)
    assert fast == sync
    assert overlapped(async_rec.steps) and not overlapped(sync_rec.steps)
    if feature == "preemption":
        assert sum(s.num_preemptions for s in async_rec.steps) > 0


def test_stop_token_ids_and_logprobs(tiny_model_factory: Callable[..., Path]) -> None:
    """A stop token taken from the greedy output ends requests mid-run (the step already
    planned after it is dropped); logprobs match too."""
    model = tiny_model_factory("llama")
    plain, _, _ = generate(model, greedy(max_tokens=20), False)
    stops = tuple({o[0][len(o[0]) // 2] for o in plain})
    params = greedy(max_tokens=20, stop_token_ids=stops, logprobs=2)
    llm_outputs = []
    for async_scheduling in (False, True):
        llm = LLM(str(model), device="cpu", async_scheduling=async_scheduling)
        llm_outputs.append(llm.generate(PROMPTS, params, use_tqdm=False))
        assert_llm_idle(llm)
    sync, fast = llm_outputs
    assert any(o.outputs[0].stop_reason in stops for o in sync)
    for s, f in zip(sync, fast, strict=True):
        assert f.outputs[0].token_ids == s.outputs[0].token_ids
        assert f.outputs[0].finish_reason == s.outputs[0].finish_reason
        assert f.outputs[0].stop_reason == s.outputs[0].stop_reason
        s_lps, f_lps = s.outputs[0].logprobs, f.outputs[0].logprobs
        assert s_lps is not None and f_lps is not None
        assert [list(p) for p in f_lps] == [list(p) for p in s_lps]


def test_stop_strings(tiny_model_with_tokenizer: Path) -> None:
    """A stop string (the front's detokenizer ends the request) gives the same text."""
    model = tiny_model_with_tokenizer
    base = LLM(str(model), device="cpu").generate(["Hello there"], greedy(max_tokens=24))
    text = base[0].outputs[0].text
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    assert stop
    params = greedy(max_tokens=24, stop=(stop,))
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(model), device="cpu", async_scheduling=async_scheduling)
        out = llm.generate(["Hello there", "Once upon"], params, use_tqdm=False)
        results.append([(o.outputs[0].text, o.outputs[0].token_ids) for o in out])
        assert_llm_idle(llm)
    assert results[0] == results[1]
    assert results[0][0][0] != text  # it stopped early


def run_with_abort(model: Path, async_scheduling: bool) -> dict[str, list[int]]:
    """Three requests; after a few steps "b" is aborted, the rest run to the end."""
    llm = LLM(str(model), device="cpu", async_scheduling=async_scheduling)
    engine = llm.engine
    for rid, prompt in zip("abc", PROMPTS, strict=False):
        engine.add_request(rid, prompt, greedy(max_tokens=16, ignore_eos=True))
    tokens: dict[str, list[int]] = {rid: [] for rid in "abc"}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
        steps += 1
        if steps == 5:
            engine.abort_requests(["b"])
    kv = engine.kv_cache_manager
    kv.check_invariants(idle=True)
    assert kv.num_free_blocks == kv.num_blocks
    return tokens


def test_abort_mid_run(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory("llama")
    sync, fast = run_with_abort(model, False), run_with_abort(model, True)
    assert fast["a"] == sync["a"] and fast["c"] == sync["c"] and len(sync["a"]) == 16
    assert 0 < len(fast["b"]) < 16 and fast["b"] == sync["b"][: len(fast["b"])]


def test_abort_everything_leaves_the_engine_idle(tiny_model_factory: Callable[..., Path]) -> None:
    """Aborting the last requests while a step is in flight drains it: idle at once."""
    llm = LLM(str(tiny_model_factory("llama")), device="cpu", async_scheduling=True)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy(max_tokens=30))
    for _ in range(3):
        engine.step()
    engine.abort_requests([str(i) for i in range(len(PROMPTS))])
    assert_llm_idle(llm)
    # And it serves again afterwards, as a synchronous engine would.
    again = llm.generate([PROMPTS[0]], greedy(max_tokens=8), use_tqdm=False)
    sync = LLM(str(tiny_model_factory("llama")), device="cpu").generate(
        [PROMPTS[0]], greedy(max_tokens=8), use_tqdm=False
    )
    assert again[0].outputs[0].token_ids == sync[0].outputs[0].token_ids
    assert_llm_idle(llm)


def test_uncovered_features_run_synchronous_steps(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """Prompt logprobs (per step) and speculative decoding (engine-wide) are not covered by
    async steps yet: those steps run synchronously, with the synchronous output."""
    model = tiny_model_factory("llama")
    params = greedy(max_tokens=8, prompt_logprobs=1)
    sync, _, _ = generate(model, params, False)
    fast, _, rec = generate(model, params, True)
    assert fast == sync and not overlapped(rec.steps)
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    spec, _, rec = generate(model, greedy(max_tokens=8), True, speculative_config=ngram)
    plain, _, _ = generate(model, greedy(max_tokens=8), False)
    assert spec == plain and not overlapped(rec.steps)
