"""Speculative decoding with a draft model: greedy tokens equal plain decoding for every
family (a draft that is the target itself: every draft accepted; a different random draft:
nearly all rejected), with sampling seeds, under preemption, after aborts and under tensor
parallelism; bad drafts are startup errors naming the flag."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_checks import assert_llm_idle
from spec_runs import PROMPTS, generate

from tokenwire.runtime.executor.uniproc import UniprocExecutor
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder

# Engine runs over many prompts and families: in make test, not in make test-fast.
pytestmark = pytest.mark.slow

FAMILIES = ["llama", "mistral", "qwen3", "gemma2", "phi3"]


def draft_config(model: Path, k: int = 3, **extra: Any) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, **extra}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_plain_decoding(tiny_model_factory: Callable[..., Path], family: str) -> None:
    """The target as its own draft proposes exactly the target's greedy tokens, so every draft
    is accepted (the catch-up, multi-token draft and settle paths); a one-layer random draft
    is nearly always wrong (the rejection path). Both give the plain tokens."""
    target = tiny_model_factory(family)
    other = tiny_model_factory(family, num_hidden_layers=1, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain, _, _ = generate(target, PROMPTS, params)
    same, llm, rec = generate(target, PROMPTS, params, speculative_config=draft_config(target))
    assert same == plain
    assert rec.drafted > 0 and rec.accepted == rec.drafted
    assert_llm_idle(llm)
    wrong, llm, rec = generate(target, PROMPTS, params, speculative_config=draft_config(other))
    assert wrong == plain
    assert rec.drafted > 0 and rec.accepted < rec.drafted
    assert_llm_idle(llm)


def test_seeded_sampling_is_reproducible_and_steps_are_fewer(
    tiny_model_factory: Callable[..., Path],
) -> None:
    target = tiny_model_factory("llama")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    spec = draft_config(target, k=4)
    first, _, rec = generate(target, PROMPTS, params, speculative_config=spec)
    second, _, _ = generate(target, PROMPTS, params, speculative_config=spec)
    assert first == second and rec.accepted > 0
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    _, _, plain_rec = generate(target, PROMPTS, greedy)
    _, _, spec_rec = generate(target, PROMPTS, greedy, speculative_config=spec)
    # Every draft accepted: 1 + 4 tokens per step instead of 1.
    assert len(spec_rec.steps) < len(plain_rec.steps) / 2


def test_preemption_and_abort_mid_speculation(tiny_model_factory: Callable[..., Path]) -> None:
    target = tiny_model_factory("llama")
    spec = draft_config(target)
    tight = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want, _, _ = generate(target, PROMPTS * 2, tight)
    got, llm, rec = generate(
        target, PROMPTS * 2, tight, speculative_config=spec, num_gpu_blocks_override=12,
        max_model_len=128,
    )  # fmt: skip
    assert got == want and rec.accepted > 0
    assert sum(s.num_preemptions for s in rec.steps) > 0
    assert_llm_idle(llm)
    recorder = StepRecorder()
    llm = LLM(str(target), device="cpu", speculative_config=spec, observer=recorder)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt * 2, SamplingParams(temperature=0.0, max_tokens=60))
    while recorder.accepted == 0:  # until a step verified (and accepted) drafts
        engine.step()
    engine.abort_requests([str(i) for i in range(len(PROMPTS))])
    engine.step()  # tells the runner (and its draft model)
    assert_llm_idle(llm)
    executor = llm.engine.executor
    assert isinstance(executor, UniprocExecutor)
    drafter = executor.worker.runner.drafter
    assert drafter is not None and not drafter.computed  # forgot the aborted requests


def test_tp2_draft_speculation_equals_tp1(tiny_model_factory: Callable[..., Path]) -> None:
    target = tiny_model_factory("llama")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain, _, _ = generate(target, PROMPTS, params)
    spec, llm, rec = generate(
        target, PROMPTS, params, speculative_config=draft_config(target),
        tensor_parallel_size=2,
    )  # fmt: skip
    try:
        assert spec == plain and rec.accepted == rec.drafted > 0
    finally:
        llm.shutdown()


def test_bad_draft_model_is_a_startup_error(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    target = tiny_model_factory("llama")
    with pytest.raises(ValueError, match=r"--speculative-config.*needs 'model'"):
        LLM(str(target), device="cpu", speculative_config={"method": "draft_model"})
    other_vocab = tiny_model_factory("llama", vocab_size=300)
    with pytest.raises(ValueError, match=r"vocab_size 300.*target's tokenizer"):
        LLM(str(target), device="cpu", speculative_config=draft_config(other_vocab))
    short = tmp_path / "short"
    short.mkdir()
    for f in target.iterdir():
        (short / f.name).write_bytes(f.read_bytes())
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="context of 64 tokens"):
        LLM(str(target), device="cpu", speculative_config=draft_config(short))
