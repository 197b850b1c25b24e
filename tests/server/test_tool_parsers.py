"""Tool-call and reasoning parsers: streamed (any split, down to one character per delta)
equals unary, tags split across deltas, malformed calls, and the tool_choice grammars."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from tokenwire.runtime.errors import ParameterError
from tokenwire.server.tool_parsers.chat import render_messages
from tokenwire.server.tool_parsers.output import OutputParsing, check_parser_names
from tokenwire.server.tool_parsers.tool_choice import FunctionSpec, ToolChoice
from tokenwire.server.tool_parsers.types import ParsedDelta, ToolCallInfo, merge_pieces

WEATHER = FunctionSpec(
    "get_weather",
    "Current weather",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = FunctionSpec("get_time", "Current time", None)


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def streamed(parsing: OutputParsing, text: str, size: int) -> ParsedDelta:
    parser = parsing.new(ids())
    total = ParsedDelta()
    for i in range(0, len(text), size):
        total.extend(parser.feed(text[i : i + size]))
    total.extend(parser.finish())
    return total


def check_stream_equals_unary(parsing: OutputParsing, text: str) -> tuple[str, str, list[Any]]:
    whole = parsing.parse(text, ids())
    for size in (1, 2, 3, 7, len(text) or 1):
        total = streamed(parsing, text, size)
        assert total.content == whole.content, size
        assert total.reasoning == whole.reasoning, size
        assert merge_pieces(total.tool_calls) == whole.tool_calls, size
        first = {}
        for piece in total.tool_calls:  # id and name come once, first
            if piece.index not in first:
                first[piece.index] = piece
                assert piece.id and piece.name and not piece.arguments
            else:
                assert not piece.id and not piece.name
    return whole.content, whole.reasoning, whole.tool_calls


HERMES = OutputParsing(tool_mode="auto", tool_call_parser="hermes")


def test_hermes_content_and_calls() -> None:
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"arguments": {}, "name": "get_time"}\n</tool_call>'
    )
    content, _, calls = check_stream_equals_unary(HERMES, text)
    assert content == "Let me check.\n\n"
    assert calls == [
        ToolCallInfo("call_0", "get_weather", '{"city": "Paris", "unit": "c"}'),
        ToolCallInfo("call_1", "get_time", "{}"),
    ]
    for call in calls:
        json.loads(call.arguments)


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        ("no calls, a < sign and <tool", "no calls, a < sign and <tool", []),
        ('<tool_call>{"name": "get_time"}', "", ["get_time"]),  # unterminated at the end
        ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
        ('x<tool_call>{"name": "a", "arguments": {"k": "</tool"}}</tool_call>y', "xy", ["a"]),
    ],
)
def test_hermes_edge_cases(text: str, content: str, names: list[str]) -> None:
    got_content, _, calls = check_stream_equals_unary(HERMES, text)
    assert got_content == content
    assert [c.name for c in calls] == names


def test_hermes_without_parallel_calls_reports_the_first() -> None:
    parsing = OutputParsing(tool_mode="auto", tool_call_parser="hermes", parallel_tool_calls=False)
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}'
    _, _, calls = check_stream_equals_unary(parsing, text)
    assert [c.name for c in calls] == ["a"]


def test_required_array_and_named() -> None:
    required = OutputParsing(tool_mode="required")
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    content, _, calls = check_stream_equals_unary(required, text)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    named = OutputParsing(tool_mode="named", function="get_weather")
    _, _, calls = check_stream_equals_unary(named, '{"city": "Rome"}')
    assert calls == [ToolCallInfo("call_0", "get_weather", '{"city": "Rome"}')]


def test_llama3_json_and_mistral() -> None:
    llama = OutputParsing(tool_mode="auto", tool_call_parser="llama3_json")
    _, _, calls = check_stream_equals_unary(
        llama, '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    )
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}'), ("b", "{}")]
    content, _, calls = check_stream_equals_unary(llama, "Just text {not a call}")
    assert content == "Just text {not a call}" and calls == []
    mistral = OutputParsing(tool_mode="auto", tool_call_parser="mistral")
    _, _, calls = check_stream_equals_unary(
        mistral, '[TOOL_CALLS][{"name": "a", "arguments": {"q": "x"}}]'
    )
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"q": "x"}')]


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [
        ("qwen3", "<think>\nstep 1\n</think>\n\nParis.", "\nstep 1\n", "Paris."),
        ("qwen3", "Paris, no thinking.", "", "Paris, no thinking."),
        ("qwen3", "<think>never closed", "never closed", ""),
        ("deepseek_r1", "plan</think>answer", "plan", "answer"),
        ("deepseek_r1", "<think>plan</think>\nanswer <think>", "plan", "answer <think>"),
    ],
)
def test_reasoning(name: str, text: str, reasoning: str, content: str) -> None:
    got = check_stream_equals_unary(OutputParsing(reasoning_parser=name), text)
    assert got[:2] == (content, reasoning)


def test_reasoning_then_tool_calls() -> None:
    parsing = OutputParsing(reasoning_parser="qwen3", tool_mode="auto", tool_call_parser="hermes")
    text = (
        "<think>I need the weather</think>\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    content, reasoning, calls = check_stream_equals_unary(parsing, text)
    assert (content, reasoning) == ("", "I need the weather")
    assert [c.name for c in calls] == ["get_weather"]


def test_tool_choice_grammars() -> None:
    tools = [WEATHER, TIME]
    required = ToolChoice("required").constraint(tools, parallel=True)
    assert required is not None and isinstance(required.json, str)
    schema = json.loads(required.json)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "nope", "parameters": {}}], schema)
    single = ToolChoice("required").constraint(tools, parallel=False)
    assert single is not None and json.loads(str(single.json))["maxItems"] == 1
    named = ToolChoice("named", "get_weather").constraint(tools, parallel=True)
    assert named is not None and json.loads(str(named.json)) == WEATHER.parameters
    assert ToolChoice("auto").constraint(tools, True) is None
    with pytest.raises(ParameterError, match="no tool is named"):
        ToolChoice("named", "nope").check(tools, "tool_choice")
    with pytest.raises(ParameterError, match="needs at least one tool"):
        ToolChoice("required").check([], "tool_choice")
    with pytest.raises(ParameterError, match="--tool-call-parser"):
        OutputParsing(tool_mode="auto")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        check_parser_names("nope", None)


def test_render_messages_for_templates_with_and_without_tools() -> None:
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1"},
    ]
    native, tools = render_messages(history, [WEATHER], "{% for t in tools %}{% endfor %}")
    assert tools == [WEATHER.openai()]
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    fallback, none = render_messages(history, [WEATHER], "{{ messages }}")
    assert none is None
    assert fallback[0]["role"] == "system" and "<tools>" in fallback[0]["content"]
    assert '"get_weather"' in fallback[0]["content"]
    assert fallback[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert fallback[3] == {"role": "user", "content": "<tool_response>\n12 C\n</tool_response>"}
