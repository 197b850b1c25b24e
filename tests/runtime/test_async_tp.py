"""Async scheduling under tensor parallelism (TP=2, gloo worker processes on CPU): the
``MultiprocExecutor`` takes step k+1 while the ranks run step k, and greedy, seeded, n > 1,
penalised, logprob, stop-token, preempted and grammar-constrained outputs equal synchronous
scheduling's token for token; the steps really overlap; after every run (an abort mid-run
included) every KV block is free, and after shutdown no worker process is left."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from engine_checks import assert_llm_idle
from step_overlap import overlapped, run_aborting_b, steps_of

from tokenwire.runtime.executor.multiproc import MultiprocExecutor
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.outputs import FinishReason, RequestOutput
from tokenwire.runtime.sampling_params import SamplingParams, StructuredOutputsParams
from tokenwire.runtime.stats import StepRecorder

# Real worker processes over several features: in make test, not in make test-fast.
pytestmark = pytest.mark.slow

PROMPTS: list[list[int]] = [
    [5, 6, 7, 8, 9],
    list(range(20, 61)),
    [11, 12, 13, 11, 12, 13, 11],
    [300, 301],
]
REGEX = r"(ab|cd){2,4}-[0-9]{3}"
CHOICES = ("alpha", "beta gamma", 'quote"d')
Choices = list[list[tuple[list[int], Any, FinishReason | None]]]


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


FEATURES: dict[str, SamplingParams | list[SamplingParams]] = {
    "greedy": greedy(max_tokens=20),
    "max_tokens_each": [greedy(max_tokens=m) for m in (1, 2, 9, 4)],
    "seeded": [SamplingParams(temperature=0.9, top_k=40, seed=i, max_tokens=16) for i in range(4)],
    "n_3_seeded": SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10),
    "penalties_logprobs": greedy(
        max_tokens=16, presence_penalty=0.5, repetition_penalty=1.2, logprobs=2
    ),
    # 339 and 264 are the 4th greedy tokens of the first two prompts.
    "stop_token_ids": greedy(max_tokens=16, stop_token_ids=(339, 264)),
    "min_tokens": greedy(max_tokens=16, min_tokens=12),  # holds back an early EOS
}


def tp2(model: Path, async_scheduling: bool, **kwargs: Any) -> LLM:
    return LLM(
        str(model),
        device="cpu",
        tensor_parallel_size=2,
        observer=StepRecorder(),
        async_scheduling=async_scheduling,
        **{"max_model_len": 256, **kwargs},
    )


def worker_pids(llm: LLM) -> list[int]:
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor)  # really the TP executor
    return executor.pids


def shut_down(llm: LLM) -> None:
    """Shut ``llm`` down and assert none of its worker processes is left."""
    pids = worker_pids(llm)
    llm.shutdown()
    left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not left, left


def choices(outputs: list[RequestOutput]) -> Choices:
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs] for o in outputs]


def same_choices(fast: Choices, sync: Choices) -> None:
    """Same tokens, finish reasons and logprob candidates (ids and ranks); logprob values
    within 1e-5 (a step's batch can differ by a row a finished request leaves behind, and
    float sums vary with the batch)."""
    assert [[(t, f) for t, _, f in o] for o in fast] == [[(t, f) for t, _, f in o] for o in sync]
    worst = 0.0
    for f_choices, s_choices in zip(fast, sync, strict=True):
        for (_, f_lps, _), (_, s_lps, _) in zip(f_choices, s_choices, strict=True):
            assert (f_lps is None) == (s_lps is None)
            for f_pos, s_pos in zip(f_lps or [], s_lps or [], strict=True):
                assert {t: lp.rank for t, lp in f_pos.items()} == {
                    t: lp.rank for t, lp in s_pos.items()
                }
                worst = max([worst, *(abs(f_pos[t].logprob - s_pos[t].logprob) for t in f_pos)])
    assert worst < 1e-5, worst


def check_run(llm: LLM, async_scheduling: bool) -> None:
    assert_llm_idle(llm)
    assert overlapped(steps_of(llm).steps) == async_scheduling


@pytest.fixture(scope="module")
def pair(tiny_model_factory: Callable[..., Path]) -> Iterator[tuple[LLM, LLM]]:
    """(synchronous, async) TP=2 engines of one tiny llama, shared by the feature cases."""
    model = tiny_model_factory("llama")
    sync = tp2(model, False)
    try:
        fast = tp2(model, True)
    except BaseException:
        shut_down(sync)
        raise
    yield sync, fast
    shut_down(sync)
    shut_down(fast)


@pytest.mark.parametrize("feature", list(FEATURES))
def test_tp2_async_equals_sync(pair: tuple[LLM, LLM], feature: str) -> None:
    params = FEATURES[feature]
    runs = []
    for llm, async_scheduling in zip(pair, (False, True), strict=True):
        runs.append(choices(llm.generate(PROMPTS, params, use_tqdm=False)))
        check_run(llm, async_scheduling)
    same_choices(runs[1], runs[0])
    if feature == "stop_token_ids":
        assert any(c[0][2] == FinishReason.STOP_TOKEN for c in runs[0]), runs[0]


def test_tp2_async_preemption(tiny_model_factory: Callable[..., Path]) -> None:
    """A device cache too small for every request: requests are preempted and recomputed."""
    model = tiny_model_factory("llama")
    small = {"max_model_len": 128, "num_gpu_blocks_override": 10, "block_size": 16}
    params = greedy(max_tokens=40, ignore_eos=True)
    runs = []
    for async_scheduling in (False, True):
        llm = tp2(model, async_scheduling, **small)
        try:
            runs.append(choices(llm.generate(PROMPTS, params, use_tqdm=False)))
            check_run(llm, async_scheduling)
            assert sum(s.num_preemptions for s in steps_of(llm).steps) > 0
        finally:
            shut_down(llm)
    same_choices(runs[1], runs[0])


def test_tp2_async_structured_outputs(tiny_model_with_tokenizer: Path) -> None:
    """Grammar bitmasks built after the step ahead is reconciled travel with their step to
    the ranks: regex and choice, seeded and greedy, one ended by the grammar alone."""
    cases = [StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=CHOICES)]
    params = [
        SamplingParams(temperature=1.0, seed=3 + i, max_tokens=60, structured_outputs=c)
        for i, c in enumerate(cases)
    ]
    params += [greedy(max_tokens=60, ignore_eos=True, structured_outputs=cases[1])]
    params += [greedy(max_tokens=12)]  # a free neighbour
    runs = []
    for async_scheduling in (False, True):
        llm = tp2(tiny_model_with_tokenizer, async_scheduling, max_model_len=512)
        try:
            outputs = llm.generate(["Answer:"] * len(params), params, use_tqdm=False)
            check_run(llm, async_scheduling)
        finally:
            shut_down(llm)
        runs.append([(o.outputs[0].text, o.outputs[0].token_ids) for o in outputs])
        assert outputs[2].outputs[0].finish_reason == FinishReason.GRAMMAR_END
    assert runs[1] == runs[0]
    assert re.fullmatch(REGEX, runs[0][0][0]) and runs[0][1][0] in CHOICES, runs[0]
    assert runs[0][2][0] in CHOICES, runs[0]


def run_with_abort(model: Path, async_scheduling: bool) -> dict[str, list[int]]:
    """Three requests; after a few steps "b" is aborted, the rest run to the end."""
    llm = tp2(model, async_scheduling)
    try:
        engine = llm.engine
        tokens = run_aborting_b(llm, PROMPTS, greedy(max_tokens=16, ignore_eos=True))
        assert_llm_idle(llm)
        # Abort everything with a step in flight: the engine drains it and is idle at once.
        for rid, prompt in zip("de", PROMPTS, strict=False):
            engine.add_request(rid, prompt, greedy(max_tokens=30))
        for _ in range(3):
            engine.step()
        engine.abort_requests(["d", "e"])
        assert_llm_idle(llm)
    finally:
        shut_down(llm)
    return tokens


def test_tp2_abort_mid_run(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory("llama")
    sync, fast = run_with_abort(model, False), run_with_abort(model, True)
    assert fast["a"] == sync["a"] and fast["c"] == sync["c"] and len(sync["a"]) == 16
    assert 0 < len(fast["b"]) < 16 and fast["b"] == sync["b"][: len(fast["b"])]
