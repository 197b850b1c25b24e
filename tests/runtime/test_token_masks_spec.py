"""``allowed_token_ids`` and ``bad_words`` under n-gram speculative decoding and async
scheduling: greedy tokens equal the plain engine's with the same masks (which
``test_token_masks`` holds to HF ``generate()``), drafts are made and accepted, and a draft
that the masks forbid (a bad word's last token after its prefix) is never emitted."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_checks import assert_llm_idle
from spec_runs import PROMPTS, copying_model, generate

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
MODES: dict[str, dict[str, Any]] = {
    "spec": {"speculative_config": NGRAM},
    "spec_async": {"speculative_config": NGRAM, "async_scheduling": True},
    "async": {"async_scheduling": True},
}


@pytest.fixture(scope="module")
def model(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Greedy output soon cycles: prompt lookup drafts get accepted."""
    return copying_model(tiny_model_factory("llama"), tmp_path_factory.mktemp("copying"))


def greedy(max_tokens: int = 24, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def stepped(model: Path, params: list[SamplingParams], mode: str) -> tuple[list[list[int]], int]:
    """Each prompt's tokens under ``mode``, stepped by hand as the core loop does, and how
    many steps returned tokens while the next one was already in flight."""
    recorder = StepRecorder()
    llm = LLM(str(model), device="cpu", observer=recorder, **MODES[mode])
    tokens: dict[str, list[int]] = {}
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        llm.engine.add_request(str(i), prompt, p)
        tokens[str(i)] = []
    ahead = 0
    while llm.engine.has_unfinished_requests():
        outputs = llm.engine.step()
        for output in outputs:
            tokens[output.request_id].extend(output.new_token_ids)
        ahead += bool(outputs) and llm.engine.step_in_flight
    if "speculative_config" in MODES[mode]:
        assert recorder.drafted > 0 and recorder.accepted > 0
    assert_llm_idle(llm)
    return [tokens[str(i)] for i in range(len(PROMPTS))], ahead


def check_mode(model: Path, params: list[SamplingParams], mode: str) -> list[list[int]]:
    """The masked run under ``mode`` equals the plain engine's; returns its tokens."""
    reference, _, _ = generate(model, PROMPTS, params)
    got, ahead = stepped(model, params, mode)
    assert got == [choices[0] for choices in reference]
    assert (ahead > 0) == ("async_scheduling" in MODES[mode])  # async steps did overlap
    return got


@pytest.mark.parametrize("mode", list(MODES))
def test_allowed_token_ids(model: Path, mode: str) -> None:
    allowed = [sorted(set(p))[: len(set(p)) - 1] for p in PROMPTS]  # all but the largest
    tokens = check_mode(model, [greedy(allowed_token_ids=a) for a in allowed], mode)
    for out, a in zip(tokens, allowed, strict=True):
        assert set(out) <= set(a)


@pytest.mark.parametrize("mode", list(MODES))
def test_bad_words(model: Path, mode: str) -> None:
    # 64 tokens: once a ban breaks the plain output's cycle, the output finds another one
    plain, _, _ = generate(model, PROMPTS, greedy(64))
    # per prompt: a token pair the plain output repeats, and one token it has
    words = [[(out[0][4], out[0][5]), (out[0][8],)] for out in plain]
    params = [greedy(64, bad_words_token_ids=w) for w in words]
    tokens = check_mode(model, params, mode)
    for out, (pair, (single,)), before in zip(tokens, words, plain, strict=True):
        assert single not in out and pair not in list(itertools.pairwise(out))
        assert out != before[0]
