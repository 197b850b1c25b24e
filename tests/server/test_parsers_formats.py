"""The newer tool-call formats on recorded model outputs: Qwen3-Coder XML, pythonic (Llama
3.2 / 4), DeepSeek-V3 and V3.1, gpt-oss Harmony (openai-harmony), Granite, and Hermes-2-Pro's
arguments-first JSON. Each output is parsed whole and streamed split at every character
boundary and in random chunkings: content, reasoning and calls must be the same, each call's
id and name come once, first, no delta carries a piece of a marker, and every call's
arguments are one JSON object.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from tokenwire.server.tool_parsers.detect import parser_for_template
from tokenwire.server.tool_parsers.output import TOOL_PARSERS, OutputParsing
from tokenwire.server.tool_parsers.tool_choice import FunctionSpec
from tokenwire.server.tool_parsers.types import ParsedDelta, ToolCallInfo, merge_pieces

WEATHER = FunctionSpec(
    "get_weather",
    "Forecast",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "hours": {"type": "array", "items": {"type": "integer"}},
            "zip": {"type": "string"},
        },
        "required": ["city"],
    },
)
TIME = FunctionSpec("get_time", "Local time", None)
TOOLS = (WEATHER, TIME)
# Pieces of markers that must never reach a client in content or reasoning around calls.
MARKER_PIECES = ("<tool_call", "<function=", "<parameter=", "<｜tool", "<|channel|", "<|message")


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def auto(parser: str, **kwargs: Any) -> OutputParsing:
    return OutputParsing(tool_mode="auto", tool_call_parser=parser, tools=TOOLS, **kwargs)


def _chunkings(text: str) -> list[list[str]]:
    """Every character on its own, every split of the text in two, and random chunkings."""
    out = [list(text), [text]]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    for seed in range(20):
        rng, pieces, i = random.Random(seed), [], 0
        while i < len(text):
            size = rng.randint(1, 12)
            pieces.append(text[i : i + size])
            i += size
        out.append(pieces)
    return out


def _check_stream(parsing: OutputParsing, pieces: list[str], whole: Any) -> None:
    parser = parsing.new(ids())
    total = ParsedDelta()
    for n, piece in enumerate(pieces):
        delta = parser.step(piece, final=n == len(pieces) - 1)
        assert len({p.index for p in delta.tool_calls}) == len(delta.tool_calls)
        total.extend(delta)
    if not pieces:
        total.extend(parser.step("", final=True))
    assert total.content == whole.content, pieces
    assert total.reasoning == whole.reasoning, pieces
    assert merge_pieces(total.tool_calls) == whole.tool_calls, pieces
    seen: set[int] = set()
    for piece in total.tool_calls:
        if piece.index not in seen:
            seen.add(piece.index)
            assert piece.id and piece.name
        else:
            assert not piece.id and not piece.name


def parse_everywhere(parsing: OutputParsing, text: str) -> tuple[str, str, list[ToolCallInfo]]:
    """The unary parse, checked against every streamed chunking of ``text``."""
    whole = parsing.parse(text, ids())
    for pieces in _chunkings(text):
        _check_stream(parsing, pieces, whole)
    for call in whole.tool_calls:
        assert isinstance(json.loads(call.arguments), dict), call
    if whole.tool_calls:  # deltas add up to these: none carried a piece of a marker
        for text in (whole.content, whole.reasoning):
            assert not any(m in text for m in MARKER_PIECES), text
    return whole.content, whole.reasoning, whole.tool_calls


def calls_of(calls: list[ToolCallInfo]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# ---------------------------------------------------------------------------- qwen3_coder
QWEN3_CODER = (
    "I'll check both for you.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
    "San Francisco, CA\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\n"
    "true\n</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n<parameter=zip>\n"
    "94103\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
    "</function>\n</tool_call>"
)


def test_qwen3_coder_calls_typed_by_the_schema() -> None:
    content, _, calls = parse_everywhere(auto("qwen3_coder"), QWEN3_CODER)
    assert content == "I'll check both for you.\n\n"
    assert calls_of(calls) == [
        (
            "get_weather",
            {
                "city": "San Francisco, CA",
                "days": 3,
                "metric": True,
                "hours": [9, 12],
                "zip": "94103",
            },
        ),
        ("get_time", {}),
    ]
    assert [c.id for c in calls] == ["call_0", "call_1"]


@pytest.mark.parametrize(
    ("text", "content", "expected"),
    [
        ("no tools here < and <tool", "no tools here < and <tool", []),
        # cut by max_tokens inside a parameter: what was written is its value
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo",
            "",
            [("get_weather", {"city": "Oslo"})],
        ),
        # no function header: the model's text, as written
        ("a <tool_call> b </tool_call> c", "a <tool_call> b </tool_call> c", []),
        # a value that looks like a closing tag's start; unknown parameters stay text
        (
            "<tool_call><function=get_weather><parameter=city></param</parameter>"
            "<parameter=other>7</parameter></function></tool_call>",
            "",
            [("get_weather", {"city": "</param", "other": "7"})],
        ),
    ],
)
def test_qwen3_coder_edge_cases(text: str, content: str, expected: list[Any]) -> None:
    got_content, _, calls = parse_everywhere(auto("qwen3_coder"), text)
    assert got_content == content
    assert calls_of(calls) == expected


def test_qwen3_coder_without_parallel_calls_reports_the_first() -> None:
    _, _, calls = parse_everywhere(auto("qwen3_coder", parallel_tool_calls=False), QWEN3_CODER)
    assert [c.name for c in calls] == ["get_weather"]


# ---------------------------------------------------------------------------- pythonic
@pytest.mark.parametrize(
    ("text", "content", "expected"),
    [
        (
            '[get_weather(city="Paris, FR", days=3, hours=[9, 12]), get_time()]',
            "",
            [("get_weather", {"city": "Paris, FR", "days": 3, "hours": [9, 12]}), ("get_time", {})],
        ),
        (  # Llama 4 with its markers, JSON literals and a string holding brackets
            '<|python_start|>[get_weather(city="a]b(c", metric=true, zip=None)]<|python_end|>',
            "",
            [("get_weather", {"city": "a]b(c", "metric": True, "zip": None})],
        ),
        ("The answer is 4.", "The answer is 4.", []),
        ("[1] is a citation.", "[1] is a citation.", []),
        ("[get_time()] Done.", " Done.", [("get_time", {})]),
        ('[get_weather(city="Oslo"', "", [("get_weather", {"city": "Oslo"})]),  # cut short
    ],
)
def test_pythonic(text: str, content: str, expected: list[Any]) -> None:
    got_content, _, calls = parse_everywhere(auto("pythonic"), text)
    assert got_content == content
    assert calls_of(calls) == expected


# ---------------------------------------------------------------------------- deepseek
DEEPSEEK_V3 = (
    "Let me look that up.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    'get_weather\n```json\n{"city": "Tokyo", "days": 2}\n```<｜tool▁call▁end｜>\n'
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜>"
)
DEEPSEEK_V31 = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Lima", "hours": [1, 2]}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)


def test_deepseek_v3_and_v31() -> None:
    content, _, calls = parse_everywhere(auto("deepseek_v3"), DEEPSEEK_V3)
    assert content == "Let me look that up."
    assert calls_of(calls) == [("get_weather", {"city": "Tokyo", "days": 2}), ("get_time", {})]
    for name in ("deepseek_v3", "deepseek_v31"):
        content, _, calls = parse_everywhere(auto(name), DEEPSEEK_V31)
        assert content == ""
        assert calls_of(calls) == [("get_weather", {"city": "Lima", "hours": [1, 2]})]
    cut = DEEPSEEK_V3[: DEEPSEEK_V3.index("```<｜tool▁call▁end｜>")]  # cut by max_tokens
    _, _, calls = parse_everywhere(auto("deepseek_v3"), cut)
    assert calls_of(calls) == [("get_weather", {"city": "Tokyo", "days": 2})]
    content, _, calls = parse_everywhere(auto("deepseek_v3"), "Plain answer, <｜tool")
    assert (content, calls) == ("Plain answer, <｜tool", [])


# ---------------------------------------------------------------------------- harmony
GPT_OSS = (
    "<|channel|>analysis<|message|>The user asks for the weather in Zürich. I should call "
    "get_weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
    '<|constrain|>json<|message|>{"city": "Zürich", "days": 1}<|call|>'
)
GPT_OSS_FINAL = (
    "<|channel|>analysis<|message|>2 + 2 = 4, simple.<|end|><|start|>assistant"
    "<|channel|>final<|message|>2 + 2 is **4** — 日本語 too.<|return|>"
)


def test_harmony_channels_and_calls() -> None:
    content, reasoning, calls = parse_everywhere(auto("openai"), GPT_OSS)
    assert content == ""
    assert reasoning == "The user asks for the weather in Zürich. I should call get_weather."
    assert calls_of(calls) == [("get_weather", {"city": "Zürich", "days": 1})]
    # the stop token (<|call|>) is usually not in the text at all
    _, _, calls = parse_everywhere(auto("openai"), GPT_OSS.removesuffix("<|call|>"))
    assert calls_of(calls) == [("get_weather", {"city": "Zürich", "days": 1})]
    content, reasoning, calls = parse_everywhere(auto("openai"), GPT_OSS_FINAL)
    assert (content, reasoning, calls) == ("2 + 2 is **4** — 日本語 too.", "2 + 2 = 4, simple.", [])
    content, _, calls = parse_everywhere(auto("openai"), "Not Harmony at all.")
    assert (content, calls) == ("Not Harmony at all.", [])


def test_harmony_as_reasoning_parser_and_special_tokens() -> None:
    parsing = OutputParsing(reasoning_parser="openai_gptoss")
    content, reasoning, calls = parse_everywhere(parsing, GPT_OSS_FINAL)
    assert (content, reasoning, calls) == ("2 + 2 is **4** — 日本語 too.", "2 + 2 = 4, simple.", [])
    assert parsing.needs_special_tokens and auto("openai").needs_special_tokens
    assert not auto("hermes").needs_special_tokens
    both = auto("openai", reasoning_parser="openai_gptoss")
    _, reasoning, calls = parse_everywhere(both, GPT_OSS)
    assert reasoning.startswith("The user asks") and [c.name for c in calls] == ["get_weather"]


# ---------------------------------------------------------------------------- granite, hermes
def test_granite_and_hermes_2_pro() -> None:
    granite = (
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Boston", "days": 1}}, '
        '{"name": "get_time", "arguments": {}}]'
    )
    _, _, calls = parse_everywhere(auto("granite"), granite)
    assert calls_of(calls) == [("get_weather", {"city": "Boston", "days": 1}), ("get_time", {})]
    # Hermes-2-Pro writes the arguments before the name
    hermes_2_pro = (
        '<tool_call>\n{"arguments": {"city": "Rome", "days": 4}, "name": "get_weather"}\n'
        "</tool_call>"
    )
    _, _, calls = parse_everywhere(auto("hermes"), hermes_2_pro)
    assert calls_of(calls) == [("get_weather", {"city": "Rome", "days": 4})]


# ---------------------------------------------------------------------------- registry
QWEN3_CODER_TEMPLATE = (
    "{%- if tools %}<tools>{{ tools }}</tools>\nIf you choose to call a function ONLY reply in "
    "the following format:\n<tool_call>\n<function=example_function_name>\n"
    "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>{%- endif %}"
)
GPT_OSS_TEMPLATE = (
    "{%- if tools %}namespace functions {{ tools }}{%- endif %}"
    "<|start|>assistant<|channel|>final<|message|>"
)
DEEPSEEK_TEMPLATE = "{%- if tools %}{{ tools }}{%- endif %}<｜tool▁calls▁begin｜><｜tool▁sep｜>"
LLAMA4_TEMPLATE = (
    "{%- if tools %}If you decide to invoke any of the function(s), you MUST put it in the "
    "format of [func_name1(params_name1=params_value1, params_name2=params_value2...), "
    "func_name2(params)]{{ tools }}{%- endif %}"
)
GRANITE_TEMPLATE = (
    "{%- if tools %}<|start_of_role|>available_tools {{ tools }}<|tool_call|>{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        (QWEN3_CODER_TEMPLATE, "qwen3_coder"),
        (GPT_OSS_TEMPLATE, "openai"),
        (DEEPSEEK_TEMPLATE, "deepseek_v3"),
        (LLAMA4_TEMPLATE, "pythonic"),
        (GRANITE_TEMPLATE, "granite"),
    ],
)
def test_templates_pick_the_new_parsers(template: str, parser: str) -> None:
    assert parser_for_template(template) == parser
    assert parser in TOOL_PARSERS
