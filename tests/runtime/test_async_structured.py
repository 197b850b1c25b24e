"""Async scheduling with structured outputs: step k+1 is planned (and its forward runs) before
step k's tokens are back; its grammar bitmask is built once they are, and the worker waits for
it only to sample. Greedy and seeded outputs equal synchronous scheduling's token for token
(JSON schemas, regex, choice, EBNF grammars; EOS forced when the grammar ends, grammars that
end without a stop token, n > 1, free neighbours, preemption), the steps really overlap, and
the engine is idle with every KV block free afterwards."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from engine_checks import assert_llm_idle
from step_overlap import overlapped, steps_of
from transformers import AutoTokenizer

from tokenwire.bench.structured_schemas import BOUNDED_SCHEMAS
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.outputs import FinishReason
from tokenwire.runtime.sampling_params import SamplingParams, StructuredOutputsParams
from tokenwire.runtime.stats import StepRecorder

# Engine runs over several constraints: in make test, not in make test-fast.
pytestmark = pytest.mark.slow

EOS = 2  # the tiny models' EOS (conftest)
PROMPT = "Answer in JSON:"
GRAMMAR = """
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
"""
REGEX = r"(ab|cd){2,4}-[0-9]{3}"
CHOICES = ("alpha", "beta gamma", 'quote"d')
Choices = list[list[tuple[str, list[int], FinishReason | None]]]


def constrained(**kwargs: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def seeded(seed: int, constraint: StructuredOutputsParams, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, structured_outputs=constraint, **kw)


def run(
    model: Path,
    prompts: list[str],
    params: list[SamplingParams],
    async_scheduling: bool,
    **kwargs: Any,
) -> tuple[Choices, LLM]:
    kwargs = {"max_model_len": 512, **kwargs}
    llm = LLM(
        str(model),
        device="cpu",
        observer=StepRecorder(),
        async_scheduling=async_scheduling,
        **kwargs,
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_llm_idle(llm)
    assert overlapped(steps_of(llm).steps) == async_scheduling
    return [[(c.text, c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs], llm


def both(model: Path, prompts: list[str], params: list[SamplingParams], **kw: Any) -> Choices:
    """The async run's choices, asserted equal to the synchronous run's."""
    sync, _ = run(model, prompts, params, False, **kw)
    fast, _ = run(model, prompts, params, True, **kw)
    assert fast == sync
    return fast


def json_case() -> list[SamplingParams]:
    return [
        seeded(100 + i, constrained(json=schema, disable_any_whitespace=True), max_tokens=200)
        for i, schema in enumerate(BOUNDED_SCHEMAS.values())
    ]


def regex_choice_grammar_case() -> list[SamplingParams]:
    cases = [constrained(regex=REGEX), constrained(choice=CHOICES), constrained(grammar=GRAMMAR)]
    sampled = [seeded(7 + 3 * i + j, c, max_tokens=80) for i, c in enumerate(cases) for j in (0, 1)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=c) for c in cases]
    return sampled + greedy


def test_json_schemas_async_equals_sync(tiny_model_with_tokenizer: Path) -> None:
    params = json_case()
    outs = both(tiny_model_with_tokenizer, [PROMPT] * len(params), params)
    for schema, out in zip(BOUNDED_SCHEMAS.values(), outs, strict=True):
        text, _, finish = out[0]
        assert finish == FinishReason.EOS, text
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_grammar_async_equals_sync(tiny_model_with_tokenizer: Path) -> None:
    params = regex_choice_grammar_case()
    outs = [o[0] for o in both(tiny_model_with_tokenizer, [PROMPT] * len(params), params)]
    assert all(finish == FinishReason.EOS for _, _, finish in outs)
    for text, _, _ in outs[0:2] + outs[6:7]:
        assert re.fullmatch(REGEX, text), text
    assert all(text in CHOICES for text, _, _ in outs[2:4] + outs[7:8])
    for text, _, _ in outs[4:6] + outs[8:9]:
        assert re.fullmatch(r"[0-9+\-()]+", text), text


def test_grammar_end_forces_eos_async(tiny_model_with_tokenizer: Path) -> None:
    """The model is pushed to EOS every step; the grammar holds it back until complete, then
    EOS ends the request (async: the step planned after it is dropped). With ``ignore_eos``
    and no stop token the grammar's completion itself ends it."""
    target = "the quick brown fox jumps over the lazy dog"
    eager = {EOS: 100.0}
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=60,
            logit_bias=eager,
            structured_outputs=constrained(regex=target),  # letters and spaces
        ),
        SamplingParams(
            temperature=0.0,
            max_tokens=60,
            ignore_eos=True,
            structured_outputs=constrained(choice=CHOICES),
        ),
        seeded(3, constrained(regex=REGEX), max_tokens=60, ignore_eos=True),
    ]
    outs = [o[0] for o in both(tiny_model_with_tokenizer, [PROMPT] * 3, params)]
    assert outs[0][0] == target and outs[0][1][-1] == EOS and outs[0][2] == FinishReason.EOS
    # Ended by the grammar alone (its last token is content, not a stop token): the reason
    # says so and the text keeps that last token (it decodes to the whole text).
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_with_tokenizer)
    for text, tokens, finish in outs[1:]:
        assert EOS not in tokens and len(tokens) < 60
        assert finish == FinishReason.GRAMMAR_END, text
        assert text == tokenizer.decode(tokens)
    assert outs[1][0] in CHOICES and re.fullmatch(REGEX, outs[2][0]), outs


def test_n_choices_and_free_neighbours_async(tiny_model_with_tokenizer: Path) -> None:
    """n = 4 seeded JSON choices batched with free greedy and seeded requests."""
    schema = BOUNDED_SCHEMAS["array_of_objects"]
    json_n = SamplingParams(
        n=4,
        temperature=1.0,
        seed=5,
        max_tokens=120,
        structured_outputs=constrained(json=schema, disable_any_whitespace=True),
    )
    free = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=42, max_tokens=24, logprobs=2),
    ]
    prompts = [PROMPT, "Once upon a time", "Numbers:"]
    outs = both(tiny_model_with_tokenizer, prompts, [json_n, *free])
    texts = [text for text, _, _ in outs[0]]
    assert len(set(texts)) > 1
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_preempted_constrained_requests_async(tiny_model_with_tokenizer: Path) -> None:
    """Few KV blocks: constrained requests are preempted (while a step is in flight) and
    recomputed; their matchers stay in step with the kept tokens."""
    params = [
        seeded(
            s,
            constrained(json=BOUNDED_SCHEMAS["nested_object"], disable_any_whitespace=True),
            max_tokens=80,
        )
        for s in range(6)
    ]
    prompt = "Describe a person who lives in a city, as JSON:"
    cramped = {"max_model_len": 128, "block_size": 4, "num_gpu_blocks_override": 40}
    sync, _ = run(tiny_model_with_tokenizer, [prompt] * 6, params, False, **cramped)
    fast, llm = run(tiny_model_with_tokenizer, [prompt] * 6, params, True, **cramped)
    assert fast == sync
    assert llm.engine.scheduler.num_preemptions_total > 0
