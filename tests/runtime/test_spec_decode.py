"""Speculative decoding (n-gram prompt lookup): greedy tokens equal plain decoding for every
family (also when a request ends inside an accepted run, with stop strings, n > 1, under
preemption and tensor parallelism); the rejection sampler follows the target distribution;
aborts mid-speculation leave every block free."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_checks import assert_llm_idle
from spec_runs import PROMPTS, copying_model, generate

from tokenwire.runtime.core.spec.ngram import find_draft
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sample.rejection import verify_drafts
from tokenwire.runtime.sample.sampling_metadata import RowSamplingState
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder

# Engine runs over many prompts and families: in make test, not in make test-fast.
pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


# ---------------------------------------------------------------------- proposer
def test_find_draft_takes_the_longest_latest_match() -> None:
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3])
    # Suffix [2, 3] occurs at 1 and 5; the latest (5) continues with 7, 8, 2.
    assert find_draft(tokens, 1, 3, 3) == [7, 8, 2]
    # The 3-token suffix [8, 2, 3] never occurred before: it falls back to shorter ones.
    assert find_draft(np.array([4, 5, 6, 4, 5]), 1, 3, 5) == [6, 4, 5]
    assert find_draft(np.array([1, 2, 3, 4]), 1, 3, 2) == []
    assert find_draft(np.array([7]), 1, 3, 2) == []
    assert find_draft(np.array([3, 3, 3]), 2, 2, 4) == [3]


# ---------------------------------------------------------------------- greedy equality
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_equals_plain_decoding(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, family: str
) -> None:
    """A random model (drafts mostly rejected: the rollback path) and a copying one (drafts
    mostly accepted) give exactly the plain greedy tokens."""
    random_model = tiny_model_factory(family)
    copying = copying_model(random_model, tmp_path / "copying")
    params = SamplingParams(temperature=0.0, max_tokens=24)
    # The copying model's prompts end inside its own greedy cycle.
    warm, _, _ = generate(copying, PROMPTS, SamplingParams(temperature=0.0, max_tokens=40))
    cycling = [p + w[0] for p, w in zip(PROMPTS, warm, strict=True)]
    for model, prompts in ((random_model, PROMPTS), (copying, cycling)):
        plain, _, _ = generate(model, prompts, params)
        spec, llm, rec = generate(model, prompts, params, speculative_config=NGRAM)
        assert spec == plain
        assert rec.drafted > 0
        assert sum(r.num_accepted_tokens for r in rec.requests) == rec.accepted
        assert_llm_idle(llm)
    assert rec.accepted > rec.drafted // 4  # the copying model: speculation really hits


def test_ends_inside_an_accepted_run(tiny_model_factory: Callable[..., Path]) -> None:
    """max_tokens, a stop token and EOS inside a run of accepted drafts end the request at the
    same token as plain decoding (one batch per kind of ending, each prompt its own stop)."""
    model = tiny_model_factory("llama")
    base = SamplingParams(temperature=0.0, max_tokens=24)
    plain, _, _ = generate(model, PROMPTS, base)
    stops = [
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[r[0][9]]) for r in plain
    ]
    for params in ([SamplingParams(temperature=0.0, max_tokens=7)] * len(PROMPTS), stops):
        want, _, _ = generate(model, PROMPTS, params)
        got, llm, _ = generate(model, PROMPTS, params, speculative_config=NGRAM)
        assert got == want
        assert all(len(w[0]) < 24 for w in want)  # every request ended early
        assert_llm_idle(llm)


def test_penalties_and_min_tokens_are_exact(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Position j of a draft run sees d_1 .. d_j as output: repetition / presence /
    frequency penalties and the min_tokens mask give plain decoding's tokens."""
    model = copying_model(tiny_model_factory("llama"), tmp_path / "copying")
    warm, _, _ = generate(model, PROMPTS, SamplingParams(temperature=0.0, max_tokens=30))
    prompts = [p + w[0] for p, w in zip(PROMPTS, warm, strict=True)]
    stop = warm[0][0][-1]  # a token of the cycle: min_tokens must hold it back
    params = SamplingParams(
        temperature=0.0, max_tokens=20, repetition_penalty=1.05, presence_penalty=0.05,
        frequency_penalty=0.02, min_tokens=6, stop_token_ids=[stop],
    )  # fmt: skip
    plain, _, _ = generate(model, prompts, params)
    spec, llm, rec = generate(model, prompts, params, speculative_config=NGRAM)
    assert spec == plain and rec.drafted > 0
    assert_llm_idle(llm)


def test_logprobs_with_speculation_equal_plain_decoding(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """A request that wants logprobs is drafted too: every emitted token (accepted drafts and
    the bonus) reports the chosen token's logprob and rank and the top-k, equal to plain
    decoding's; a run that ends inside (max_tokens) reports one entry per token."""
    model = copying_model(tiny_model_factory("llama"), tmp_path / "copying")
    warm, _, _ = generate(model, PROMPTS, SamplingParams(temperature=0.0, max_tokens=30))
    prompts = [p + w[0] for p, w in zip(PROMPTS, warm, strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=15, logprobs=3)
    llm = LLM(str(model), device="cpu")
    plain = llm.generate(prompts, params, use_tqdm=False)
    recorder = StepRecorder()
    spec_llm = LLM(str(model), device="cpu", observer=recorder, speculative_config=NGRAM)
    spec = spec_llm.generate(prompts, params, use_tqdm=False)
    assert recorder.accepted > len(prompts)  # runs of several tokens per step happened
    for got, want in zip(spec, plain, strict=True):
        g, w = got.outputs[0], want.outputs[0]
        assert g.token_ids == w.token_ids
        assert g.logprobs is not None and w.logprobs is not None
        assert len(g.logprobs) == len(g.token_ids) == 15
        for position, expected in zip(g.logprobs, w.logprobs, strict=True):
            assert list(position) == list(expected)  # chosen token, then the top 3
            for token, entry in expected.items():
                assert position[token].rank == entry.rank
                assert position[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
    assert_llm_idle(spec_llm)


def test_stop_strings_n_and_preemption(tiny_model_with_tokenizer: Path, tmp_path: Path) -> None:
    model = copying_model(tiny_model_with_tokenizer, tmp_path / "copying")
    warm, _, _ = generate(model, PROMPTS, SamplingParams(temperature=0.0, max_tokens=30))
    prompts = [p + w[0] for p, w in zip(PROMPTS, warm, strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=24, n=2)
    plain, llm, _ = generate(model, prompts, params)
    spec, _, rec = generate(model, prompts, params, speculative_config=NGRAM)
    assert spec == plain and rec.accepted > 0
    text = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # inside a run, across token boundaries
    with_stop = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])
    a = llm.generate(prompts, with_stop, use_tqdm=False)
    b = LLM(str(model), device="cpu", speculative_config=NGRAM).generate(
        prompts, with_stop, use_tqdm=False
    )
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]
    assert [o.outputs[0].finish_reason for o in a] == [o.outputs[0].finish_reason for o in b]
    assert any(o.outputs[0].stop_reason == stop for o in b)
    # Few blocks: requests are preempted (recomputed) while speculating.
    tight = SamplingParams(temperature=0.0, max_tokens=40)
    want, _, _ = generate(model, prompts * 2, tight)
    got, llm2, rec2 = generate(
        model,
        prompts * 2,
        tight,
        speculative_config=NGRAM,
        num_gpu_blocks_override=16,
        max_model_len=128,
    )
    assert got == want and rec2.accepted > 0
    assert sum(s.num_preemptions for s in rec2.steps) > 0
    assert_llm_idle(llm2)


def test_abort_mid_speculation_frees_every_block(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = copying_model(tiny_model_factory("llama"), tmp_path / "copying")
    recorder = StepRecorder()
    llm = LLM(str(model), device="cpu", speculative_config=NGRAM, observer=recorder)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt * 2, SamplingParams(temperature=0.0, max_tokens=60))
    while recorder.accepted == 0:  # until a step verified (and accepted) drafts
        engine.step()
    engine.abort_requests([str(i) for i in range(len(PROMPTS))])
    engine.step()  # tells the runner
    assert_llm_idle(llm)


def test_seeded_sampling_is_reproducible_with_speculation(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model = tiny_model_factory("llama")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20)
    first, _, rec = generate(model, PROMPTS, params, speculative_config=NGRAM)
    second, _, _ = generate(model, PROMPTS, params, speculative_config=NGRAM)
    assert first == second and rec.drafted > 0


def test_disable_by_batch_size_falls_back_to_plain_decoding(
    tiny_model_factory: Callable[..., Path],
) -> None:
    config = dict(NGRAM, disable_by_batch_size=2)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    plain, _, _ = generate(tiny_model_factory("llama"), PROMPTS, params)
    spec, _, rec = generate(tiny_model_factory("llama"), PROMPTS, params, speculative_config=config)
    assert spec == plain
    assert all(s.num_draft_tokens == 0 for s in rec.steps if s.num_seqs >= 2)


def test_tp2_speculation_equals_tp1(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = copying_model(tiny_model_factory("llama"), tmp_path / "copying")
    warm, _, _ = generate(model, PROMPTS, SamplingParams(temperature=0.0, max_tokens=30))
    prompts = [p + w[0] for p, w in zip(PROMPTS, warm, strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    plain, _, _ = generate(model, prompts, params)
    spec, llm, rec = generate(
        model, prompts, params, speculative_config=NGRAM, tensor_parallel_size=2
    )
    try:
        assert spec == plain and rec.accepted > 0
    finally:
        llm.shutdown()


def test_bad_speculative_config_names_the_flag() -> None:
    for bad in (
        {"method": "eagle"},
        {"num_speculative_tokens": 0},
        {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
        {"nope": 1},
    ):
        with pytest.raises(ValueError, match="--speculative-config"):
            LLM(speculative_config=bad)


# ---------------------------------------------------------------------- rejection sampler
def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability zero"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_follows_the_target_distribution() -> None:
    """Position 0: every emitted first token ~ p0 (the draft accepted with p0(d), else the
    residual); position 1, given the first draft was accepted: ~ p1. Chi-square against the
    exact distributions over 4000 seeded draws (critical value at p = 0.001, 7 dof: 24.3)."""
    vocab = 8
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g) * 1.5
    params = SamplingParams(temperature=0.9, seed=1)
    draft = [3, 5]
    p = torch.softmax(logits / 0.9, dim=-1).numpy().astype(np.float64)
    first = np.zeros(vocab)
    second = np.zeros(vocab)
    generator = torch.Generator().manual_seed(1234)
    row = RowSamplingState(params, generator, [1], [])
    for _ in range(4000):
        out = verify_drafts(logits, [row], [draft], vocab, None)[0]
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    assert _chi_square(first, p[0]) < 24.3
    assert _chi_square(second, p[1]) < 24.3
    assert 0.6 * p[0][3] < first[3] / 4000 < 1.4 * p[0][3]


def test_greedy_verification_accepts_the_argmax_prefix() -> None:
    logits = torch.full((3, 6), -5.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = 5.0
    row = RowSamplingState(SamplingParams(temperature=0.0), None, [1], [])
    assert verify_drafts(logits, [row], [[2, 4]], 6, None) == [[2, 4, 1]]
    assert verify_drafts(logits, [row], [[2, 3]], 6, None) == [[2, 4]]
    assert verify_drafts(logits, [row], [[0, 4]], 6, None) == [[2]]


def test_edit_workload_prompts_hold_their_passages(smollm_tokenizer: Any) -> None:
    """The ``edit`` bench workload: chat prompts (the model's template) that contain the
    passage the answer should copy; the token-id workloads need no tokenizer."""
    from tokenwire.bench.edit_texts import PASSAGES
    from tokenwire.bench.workloads import make_workload

    with pytest.raises(ValueError, match="tokenizer"):
        make_workload("edit", 49152)
    workload = make_workload("edit", 49152, tokenizer=smollm_tokenizer)
    assert len(workload.prompts) == 16 and workload.output_lens == [64] * 16
    for i, prompt in enumerate(workload.prompts):
        text = smollm_tokenizer.decode(prompt)
        assert PASSAGES[i % len(PASSAGES)] in text and "<|im_start|>assistant" in text


def test_structured_output_speculation_is_exact(
    tiny_model_with_tokenizer: Path, tmp_path: Path
) -> None:
    """Constrained requests speculate too: drafts are cut to what the grammar accepts, each
    scored position is masked by the matcher's state after the drafts before it, and only
    verified tokens advance the matcher. Greedy outputs equal plain constrained decoding, the
    text still matches, and drafts really get accepted (the copying model cycles through the
    few a/b tokens the pattern allows; its 90-character limit cuts the last drafts)."""
    import re

    from tokenwire.runtime.sampling_params import StructuredOutputsParams

    model = copying_model(tiny_model_with_tokenizer, tmp_path / "copying")
    pattern = r"[ab]{30,90}\."
    constrained = StructuredOutputsParams(regex=pattern)
    params = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=constrained)
    prompts = [p[:12] for p in PROMPTS]
    plain, _, _ = generate(model, prompts, params)
    spec, llm, rec = generate(model, prompts, params, speculative_config=NGRAM)
    assert spec == plain
    assert rec.accepted > 0
    tokenizer = llm.get_tokenizer()
    for out in spec:
        assert re.fullmatch(pattern, tokenizer.decode(out[0], skip_special_tokens=True))
    sampled = SamplingParams(temperature=0.9, seed=3, max_tokens=48, structured_outputs=constrained)
    outs = llm.generate(prompts, sampled, use_tqdm=False)
    for o in outs:
        assert re.fullmatch(pattern, o.outputs[0].text), o.outputs[0].text
    assert_llm_idle(llm)
