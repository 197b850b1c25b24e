"""Constrained decoding with the default model (SmolLM2-135M-Instruct, real weights and
tokenizer): every test schema, JSON mode, a regex and a choice, greedy, in one batch each."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenwire.bench.structured_schemas import ALL_SCHEMAS
from tokenwire.runtime.front.tokenizer import apply_chat_template
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.outputs import FinishReason
from tokenwire.runtime.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, device="cpu", max_model_len=1024)


def chat(llm: LLM, question: str) -> list[int]:
    return apply_chat_template(llm.get_tokenizer(), [{"role": "user", "content": question}])


def test_every_schema_validates(llm: LLM) -> None:
    names = list(ALL_SCHEMAS)
    prompts = [
        chat(llm, f"Reply with a JSON value for this schema: {json.dumps(ALL_SCHEMAS[n])}")
        for n in names
    ]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=250,
            structured_outputs=StructuredOutputsParams(json=ALL_SCHEMAS[n]),
        )
        for n in names
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for name, out in zip(names, outs, strict=True):
        choice = out.outputs[0]
        assert choice.finish_reason == FinishReason.EOS, (name, choice.text)
        jsonschema.validate(json.loads(choice.text), ALL_SCHEMAS[name])
    llm.engine.kv_cache_manager.check_invariants(idle=True)


def test_json_mode_regex_and_choice(llm: LLM) -> None:
    cases = [
        (
            'Return a JSON object with the keys "city" and "country" for Paris.',
            StructuredOutputsParams(json_object=True),
        ),
        (
            "When did the Apollo 11 moon landing happen?",
            StructuredOutputsParams(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
        ),
        (
            "Is the sentence 'I love this film' positive or negative?",
            StructuredOutputsParams(choice=("positive", "negative")),
        ),
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=c) for _, c in cases
    ]
    prompts = [chat(llm, q) for q, _ in cases]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(o.finish_reason == FinishReason.EOS for o in outs), [o.text for o in outs]
    assert isinstance(json.loads(outs[0].text), dict)
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", outs[1].text)
    assert outs[2].text in ("positive", "negative")
    llm.engine.kv_cache_manager.check_invariants(idle=True)
