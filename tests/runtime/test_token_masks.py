"""``allowed_token_ids`` and ``bad_words`` (vLLM's token masks): the sampler's masks, greedy
tokens equal to HF ``generate()`` with the equivalent processors (``prefix_allowed_tokens_fn``,
``bad_words_ids``) on a tiny random model, and the parameter checks naming the field."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_checks import assert_llm_idle
from transformers import AutoModelForCausalLM

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sample.sampler import Sampler
from tokenwire.runtime.sample.sampling_metadata import RowSamplingState, build_sampling_metadata
from tokenwire.runtime.sampling_params import SamplingParams

NEW_TOKENS = 20
PROMPTS = [[(37 * i + 13 * j) % 500 + 3 for j in range(6 + 5 * i)] for i in range(3)]
EOS = 2  # the tiny models' eos_token_id


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu")


def hf_generate(model_dir: Path, prompt: list[int], **kwargs: object) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return ids[0, len(prompt) :].tolist()


def greedy(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def row(params: SamplingParams, output: list[int]) -> RowSamplingState:
    return RowSamplingState(params, None, [5, 6], output)


def test_sampler_masks_whitelist_and_bad_word_continuations() -> None:
    vocab = 16
    logits = torch.arange(vocab, dtype=torch.float32).repeat(4, 1)  # argmax: the last id
    rows = [
        row(SamplingParams(temperature=0.0, allowed_token_ids=[3, 7]), []),
        row(SamplingParams(temperature=0.0, bad_words_token_ids=[[15], [4, 14]]), [9, 4]),
        row(SamplingParams(temperature=0.0, bad_words_token_ids=[[4, 14]]), [4, 9]),
        row(SamplingParams(temperature=0.0), [4]),
    ]
    meta = build_sampling_metadata(rows, vocab, torch.device("cpu"))
    before = logits.clone()
    out = Sampler()(logits, meta).sampled_token_ids.tolist()
    # whitelist -> 7; [15] always banned and [4, 14] after a 4 -> 13; [4, 14] not after 9 -> 15
    assert out == [7, 13, 15, 15]
    assert torch.equal(logits, before)  # the input is never written


def test_random_rows_sample_only_allowed_tokens() -> None:
    vocab = 64
    allowed = [1, 9, 33]
    params = SamplingParams(temperature=1.5, seed=3, allowed_token_ids=allowed)
    gen = torch.Generator().manual_seed(3)
    meta = build_sampling_metadata(
        [RowSamplingState(params, gen, [1], [])], vocab, torch.device("cpu")
    )
    seen = {int(Sampler()(torch.randn(1, vocab), meta).sampled_token_ids[0]) for _ in range(60)}
    assert seen <= set(allowed) and len(seen) > 1


def test_allowed_token_ids_equal_hf_prefix_allowed_tokens_fn(llm: LLM, model_dir: Path) -> None:
    sets = [list(range(100, 140)), [7, 11, 300, 301, 302], list(range(3, 500, 7))]
    assert all(EOS not in s for s in sets)
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, allowed_token_ids=s) for s in sets
    ]
    ours = greedy(llm, PROMPTS, params)
    for prompt, allowed, tokens in zip(PROMPTS, sets, ours, strict=True):
        ref = hf_generate(model_dir, prompt, prefix_allowed_tokens_fn=lambda _b, _i, a=allowed: a)
        assert tokens == ref and set(tokens) <= set(allowed)
    plain = greedy(llm, PROMPTS[:1], [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)])
    assert not set(plain[0]) <= set(sets[0])  # the mask changed the answer
    assert_llm_idle(llm)


def test_bad_words_equal_hf_bad_words_ids(llm: LLM, model_dir: Path) -> None:
    plain = greedy(llm, PROMPTS, [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)] * 3)
    for prompt, out in zip(PROMPTS, plain, strict=True):
        # a one-token word the plain output has, and a two-token word it ends once
        words = [[out[2]], [out[6], out[7]]]
        # HF matches prefixes over prompt + output, vLLM over the output: keep them apart
        assert prompt[-1] != out[6]
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, bad_words_token_ids=words)
        tokens = greedy(llm, [prompt], [params])[0]
        assert tokens == hf_generate(model_dir, prompt, bad_words_ids=words)
        assert out[2] not in tokens and tokens != out
        pairs = list(itertools.pairwise(tokens))
        assert (out[6], out[7]) not in pairs
    assert_llm_idle(llm)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"bad_words_token_ids": [[]]}, "bad_words"),
        ({"bad_words_token_ids": [[1, -2]]}, "bad_words"),
    ],
)
def test_invalid_masks_name_the_parameter(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(ParameterError) as err:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert err.value.param == param


def test_ids_outside_the_vocabulary_name_the_parameter(llm: LLM) -> None:
    for params, param in [
        (SamplingParams(allowed_token_ids=[5, 512]), "allowed_token_ids"),
        (SamplingParams(bad_words_token_ids=[[5, 10_000]]), "bad_words"),
    ]:
        with pytest.raises(ParameterError) as err:
            llm.generate([PROMPTS[0]], params, use_tqdm=False)
        assert err.value.param == param and "vocabulary" in str(err.value)
    assert_llm_idle(llm)


def test_offline_llm_tokenizes_bad_words(tiny_model_with_tokenizer: Path) -> None:
    llm = LLM(str(tiny_model_with_tokenizer), device="cpu")
    tokenizer = llm.get_tokenizer()
    prompt = "The quick brown fox"
    greedy12 = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = llm.generate([prompt], greedy12, use_tqdm=False)[0].outputs[0].token_ids

    def one_token_forms(word: str) -> list[list[int]]:
        """vLLM bans the spaced form only if it has as many tokens as the plain one."""
        forms = [tokenizer.encode(f, add_special_tokens=False) for f in (word, " " + word)]
        return forms if len(forms[0]) == 1 else []

    word, token = next(
        (w, t) for t in tokens if (w := tokenizer.decode([t]).strip()) and [t] in one_token_forms(w)
    )
    params = dataclasses.replace(greedy12, bad_words=(word,))
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert token not in out and out != tokens
    assert_llm_idle(llm)
