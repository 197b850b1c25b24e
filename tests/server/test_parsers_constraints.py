"""Structural tags and the constraint of ``tool_choice: "auto"``, below the servers: the two
accepted shapes and their errors (each naming the part), the front's check (off the caller's
thread) with xgrammar's parser, and for every parser with a begin marker, a grammar that
takes exactly the calls its parser reads back with schema-valid arguments.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string as accepts

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.structured_validate import StructuredValidator
from tokenwire.runtime.sampling_params import SamplingParams, StructuredOutputsParams
from tokenwire.runtime.structured.structural_tag import canonical, normalize
from tokenwire.server.tool_parsers.auto_constraint import CONSTRAINED_PARSERS, auto_constraint
from tokenwire.server.tool_parsers.output import TOOL_PARSERS, OutputParsing
from tokenwire.server.tool_parsers.tool_choice import FunctionSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = FunctionSpec("get_weather", "Forecast", SCHEMA)
TIME = FunctionSpec("get_time", "Local time", None)
LEGACY = {
    "structures": [{"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}],
    "triggers": ["<f="],
}
PARAM = "structured_outputs.structural_tag"


def test_both_shapes_become_the_current_one() -> None:
    legacy = StructuredOutputsParams(structural_tag=LEGACY)
    as_text = StructuredOutputsParams(
        structural_tag=json.dumps({**LEGACY, "type": "structural_tag"})
    )
    assert legacy.kind == as_text.kind == "structural_tag"
    assert legacy.spec().kind == "structural_tag"
    document = json.loads(canonical(legacy.spec().text))
    assert canonical(as_text.spec().text) == canonical(legacy.spec().text)
    assert document == {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<f="],
            "tags": [
                {
                    "type": "tag",
                    "begin": "<f=a>",
                    "content": {
                        "type": "json_schema",
                        "json_schema": SCHEMA,
                        "max_whitespace_cnt": 20,  # the bound of every JSON constraint
                    },
                    "end": "</f>",
                }
            ],
        },
    }
    own = {"format": {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 0}}
    assert json.loads(canonical(json.dumps(own)))["format"]["max_whitespace_cnt"] == 0
    current = StructuredOutputsParams(structural_tag=document)
    assert canonical(current.spec().text) == canonical(legacy.spec().text)
    grammar = Grammar.from_structural_tag(canonical(current.spec().text))
    assert accepts(grammar, 'hi <f=a>{"city": "Oslo", "days": 2}</f> bye')
    assert not accepts(grammar, '<f=a>{"city": "Rome", "days": 2}</f>')


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ("{", PARAM),
        ([1], PARAM),
        ({"type": "structural_tag"}, PARAM),
        ({"format": []}, f"{PARAM}.format"),
        ({"type": "other", "format": {}}, f"{PARAM}.type"),
        ({"format": {}, "extra": 1}, PARAM),
        ({**LEGACY, "structures": []}, f"{PARAM}.structures"),
        ({**LEGACY, "triggers": [""]}, f"{PARAM}.triggers[0]"),
        (
            {**LEGACY, "structures": [{"begin": "<g>", "end": "</g>"}]},
            f"{PARAM}.structures[0].begin",
        ),
        ({**LEGACY, "structures": [{"begin": "<f=", "end": None}]}, f"{PARAM}.structures[0].end"),
        (
            {**LEGACY, "structures": [{"begin": "<f=", "end": "", "schema": 3}]},
            f"{PARAM}.structures[0].schema",
        ),
        ({**LEGACY, "structures": ["x"]}, f"{PARAM}.structures[0]"),
    ],
)
def test_bad_shapes_name_the_part(value: Any, param: str) -> None:
    text = value if isinstance(value, str) else json.dumps(value)
    with pytest.raises(ParameterError) as err:
        normalize(text, PARAM)
    assert err.value.param == param, str(err.value)
    with pytest.raises(ValueError) as bad:  # as the grammar work reports it
        canonical(text)
    part = param.removeprefix(PARAM).lstrip(".")
    assert str(bad.value).startswith(part), str(bad.value)


def test_one_constraint_only_and_text() -> None:
    with pytest.raises(ParameterError, match="exactly one"):
        StructuredOutputsParams(structural_tag=LEGACY, regex="a")
    for value in ("", {"x": float("nan")}):
        with pytest.raises(ParameterError) as err:
            StructuredOutputsParams(structural_tag=value)
        assert err.value.param == PARAM


def test_the_front_check_uses_xgrammars_parser() -> None:
    validator = StructuredValidator(has_tokenizer=True)
    try:
        good = SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=LEGACY))
        validator.check(good)
        bad_format = {"format": {"type": "tag", "begin": "<a>", "content": {"type": "nope"}}}
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=bad_format))
        with pytest.raises(ParameterError) as err:
            validator.check(bad)
        assert err.value.param == PARAM
        assert "/" not in str(err.value).split(":", 1)[1]  # no source path of xgrammar's
        part = {**LEGACY, "structures": [{"begin": "<g>", "end": "</g>"}]}
        with pytest.raises(ParameterError) as err:
            validator.check(
                SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=part))
            )
        assert err.value.param == PARAM
        assert "structures[0].begin must start with one of the triggers" in str(err.value)
    finally:
        validator.close()


# ---------------------------------------------------------------------------- auto
# (parser, a call its format writes, a call whose arguments break the schema)
CALLS = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}'
        "\n</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=town>\nParis\n</parameter>\n"
        "</function>\n</tool_call>",
    ),
    (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 7}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 9}\n```<｜tool▁call▁end｜>',
    ),
    (
        "deepseek_v31",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Oslo", "days": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": 1, "days": 1}<｜tool▁call▁end｜>',
    ),
]


@pytest.mark.parametrize(("parser", "good", "bad"), CALLS)
def test_auto_constraint_takes_the_calls_its_parser_reads(parser: str, good: str, bad: str) -> None:
    constraint = auto_constraint(parser, [WEATHER, TIME], parallel=True)
    assert constraint is not None and constraint.kind == "structural_tag"
    grammar = Grammar.from_structural_tag(constraint.spec().text)
    text = f"Let me check. {good}\nDone."
    assert accepts(grammar, text)
    assert accepts(grammar, "No call needed, the answer is 4.")
    assert not accepts(grammar, bad)
    parsed = OutputParsing(tool_mode="auto", tool_call_parser=parser, tools=(WEATHER, TIME))
    (call,) = parsed.parse(text).tool_calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)


def test_auto_constraint_without_parallel_calls_ends_after_one() -> None:
    call = CALLS[0][1]
    constraint = auto_constraint("hermes", [WEATHER], parallel=False)
    assert constraint is not None
    grammar = Grammar.from_structural_tag(constraint.spec().text)
    assert accepts(grammar, "Sure. " + call)
    assert not accepts(grammar, call + call) and not accepts(grammar, call + " more")


def test_formats_without_a_begin_marker_get_no_constraint() -> None:
    assert set(TOOL_PARSERS) >= CONSTRAINED_PARSERS
    for parser in set(TOOL_PARSERS) - CONSTRAINED_PARSERS:
        assert auto_constraint(parser, [WEATHER], parallel=True) is None, parser
    assert auto_constraint("hermes", [], parallel=True) is None
    assert auto_constraint(None, [WEATHER], parallel=True) is None
