"""Structured outputs, tools and reasoning over gRPC, against a real server whose engine core
runs in its own process (the constraint crosses the msgspec hop): a tiny random model with
the default model's tokenizer, so the grammar alone shapes every answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
from grpc_helpers import details_of
from server_harness import ServerHarness

from tokenwire.bench.structured_schemas import BOUNDED_SCHEMAS
from tokenwire.runtime.structured.config import StructuredOutputsConfig
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TOOLS = [
    common_pb2.Tool(
        function=common_pb2.FunctionDefinition(
            name="get_weather", description="Forecast", parameters_json=json.dumps(WEATHER_SCHEMA)
        )
    ),
    common_pb2.Tool(function=common_pb2.FunctionDefinition(name="get_time")),
]
HERMES_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512, tool_call_parser="hermes", reasoning_parser="qwen3")


def chat_request(
    content: str = "Hello",
    structured: common_pb2.StructuredOutput | None = None,
    max_tokens: int = 120,
    **chat: Any,
) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        chat=common_pb2.ChatInput(
            messages=[common_pb2.ChatMessage(role="user", content=content)], **chat
        ),
        sampling=common_pb2.SamplingOptions(temperature=1.0, seed=3),
        stopping=common_pb2.StoppingOptions(max_tokens=max_tokens),
        output=common_pb2.OutputOptions(structured_output=structured),
    )


def stream(
    gen: generation_pb2_grpc.GenerationServiceStub, request: generation_pb2.GenerateRequest
) -> tuple[str, str, list[common_pb2.ToolCallDelta], list[generation_pb2.ChoiceEnd]]:
    text, reasoning, pieces, ends = "", "", [], []
    for event in gen.GenerateStream(request):
        if event.HasField("delta"):
            text += event.delta.text
            reasoning += event.delta.reasoning_text
            pieces.extend(event.delta.tool_calls)
        elif event.HasField("end"):
            ends.append(event.end)
    return text, reasoning, pieces, ends


def calls_of(pieces: list[common_pb2.ToolCallDelta]) -> list[tuple[str, str]]:
    """(name, arguments) per call index, from streamed pieces."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        if piece.index not in calls:
            assert piece.id.startswith("call_") and piece.name
            calls[piece.index] = [piece.name, ""]
        else:
            assert not piece.id and not piece.name
        calls[piece.index][1] += piece.arguments
    return [(name, args) for name, args in (calls[i] for i in sorted(calls))]


def test_json_schema_unary_and_stream(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub
) -> None:
    schema = BOUNDED_SCHEMAS["defs_refs"]
    structured = common_pb2.StructuredOutput(
        json_schema=json.dumps(schema), disable_any_whitespace=True
    )
    request = chat_request(structured=structured)
    unary = gen.Generate(request).choices[0]
    assert unary.finish_reason == common_pb2.FINISH_REASON_EOS
    jsonschema.validate(json.loads(unary.text), schema)
    text, _, _, ends = stream(gen, request)
    assert text == unary.text  # seeded: the stream is the same answer
    assert ends[0].finish_reason == common_pb2.FINISH_REASON_EOS
    harness.assert_idle()


def test_choice_regex_and_grammar(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub
) -> None:
    cases = [
        (common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=["up", "down"])), None),
        (common_pb2.StructuredOutput(regex=r"[A-Z]{3}-[0-9]{2}"), r"[A-Z]{3}-[0-9]{2}"),
        (common_pb2.StructuredOutput(grammar='root ::= "a" ("b" | "c")+ "d"'), r"a[bc]+d"),
    ]
    import re

    for structured, pattern in cases:
        text = gen.Generate(chat_request(structured=structured)).choices[0].text
        if pattern is None:
            assert text in ("up", "down")
        else:
            assert re.fullmatch(pattern, text), text
    harness.assert_idle()


@pytest.mark.parametrize(
    ("structured", "param", "needle"),
    [
        (common_pb2.StructuredOutput(json_schema='{"type": "nope"}'), "json_schema", "nope"),
        (common_pb2.StructuredOutput(json_schema="{"), "json_schema", "Failed to parse JSON"),
        (common_pb2.StructuredOutput(regex="[a-"), "regex", "Unclosed"),
        (common_pb2.StructuredOutput(grammar="root ::= x"), "grammar", 'Rule "x"'),
        (common_pb2.StructuredOutput(json_object=False), "json_object", "must be true"),
        (common_pb2.StructuredOutput(choice=common_pb2.ChoiceList()), "choice", "at least one"),
    ],
)
def test_invalid_constraints_name_the_field(
    harness: ServerHarness,
    gen: generation_pb2_grpc.GenerationServiceStub,
    structured: common_pb2.StructuredOutput,
    param: str,
    needle: str,
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        gen.Generate(chat_request(structured=structured))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    error, _ = details_of(info.value)
    assert error is not None and error.metadata["param"] == f"structured_output.{param}"
    assert needle in info.value.details() and ".cc" not in info.value.details()
    harness.assert_idle()


def test_required_and_named_tool_choice(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub
) -> None:
    required = chat_request(
        "What is the weather in Oslo?",
        tools=TOOLS,
        tool_choice=common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED),
        parallel_tool_calls=False,
    )
    unary = gen.Generate(required).choices[0]
    assert unary.text == "" and len(unary.tool_calls) == 1
    call = unary.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    text, _, pieces, _ = stream(gen, required)
    assert text == "" and calls_of(pieces) == [(call.function.name, call.function.arguments)]

    named = chat_request(
        "Weather?", tools=TOOLS, tool_choice=common_pb2.ToolChoice(function_name="get_weather")
    )
    call = gen.Generate(named).choices[0].tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    _, _, pieces, _ = stream(gen, named)
    assert calls_of(pieces) == [("get_weather", call.function.arguments)]
    harness.assert_idle()


def test_auto_tool_calls_and_reasoning_are_parsed_from_text(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub
) -> None:
    """The grammar makes the random model write a Hermes call after its reasoning; the
    server's qwen3 and hermes parsers take them apart, streamed and unary alike."""
    answer = "<think>Need Oslo.</think>\n\nChecking." + HERMES_CALL
    request = chat_request(
        "Weather in Oslo?",
        common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=[answer])),
        tools=TOOLS,
    )
    unary = gen.Generate(request).choices[0]
    assert (unary.reasoning_content, unary.text) == ("Need Oslo.", "Checking.")
    assert [(c.function.name, c.function.arguments) for c in unary.tool_calls] == [
        ("get_weather", '{"city": "Oslo", "days": 2}')
    ]
    text, reasoning, pieces, _ = stream(gen, request)
    assert (reasoning, text) == ("Need Oslo.", "Checking.")
    assert calls_of(pieces) == [("get_weather", '{"city": "Oslo", "days": 2}')]
    harness.assert_idle()


def test_tool_history_is_rendered(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub
) -> None:
    """An assistant tool call and the tool's answer in the history are accepted (the
    template has no tool support, so they are written in the Hermes convention)."""
    call = common_pb2.ToolCall(
        id="call_1",
        function=common_pb2.FunctionCall(name="get_weather", arguments='{"city": "Oslo"}'),
    )
    request = generation_pb2.GenerateRequest(
        chat=common_pb2.ChatInput(
            messages=[
                common_pb2.ChatMessage(role="user", content="Weather?"),
                common_pb2.ChatMessage(role="assistant", tool_calls=[call]),
                common_pb2.ChatMessage(role="tool", content="12 C", tool_call_id="call_1"),
            ],
            tools=TOOLS,
            tool_choice=common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_NONE),
        ),
        stopping=common_pb2.StoppingOptions(max_tokens=3),
    )
    reply = gen.Generate(request)
    assert reply.usage.prompt_tokens > 20 and not reply.choices[0].tool_calls
    harness.assert_idle()


@pytest.mark.parametrize(
    ("chat", "param"),
    [
        ({"tool_choice": common_pb2.ToolChoice(function_name="nope")}, "tool_choice"),
        (
            {
                "tools": [
                    common_pb2.Tool(
                        function=common_pb2.FunctionDefinition(name="f", parameters_json="[")
                    )
                ]
            },
            "tools",
        ),
        (
            {
                "tools": [
                    common_pb2.Tool(
                        function=common_pb2.FunctionDefinition(
                            name="f", parameters_json='{"type": "nope"}'
                        )
                    )
                ],
                "tool_choice": common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED),
            },
            "tools",
        ),
    ],
)
def test_invalid_tools_name_the_field(
    gen: generation_pb2_grpc.GenerationServiceStub, chat: dict[str, Any], param: str
) -> None:
    chat.setdefault("tools", TOOLS)
    with pytest.raises(grpc.RpcError) as info:
        gen.Generate(chat_request(**chat))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    error, _ = details_of(info.value)
    assert error is not None and error.metadata["param"] == param


def test_compile_time_out_is_a_clear_error(
    tiny_model_with_tokenizer: Path, tiny_model_factory: Callable[..., Path]
) -> None:
    """A constraint whose compile outlives the core's limit fails INVALID_ARGUMENT naming
    the field (in-process core, its limit lowered for the test)."""
    h = ServerHarness(tiny_model_with_tokenizer, in_process=True).start()
    try:
        h.core.structured.pool.config = StructuredOutputsConfig(compile_timeout=1e-6)
        with h.channel() as channel:
            gen = generation_pb2_grpc.GenerationServiceStub(channel)
            structured = common_pb2.StructuredOutput(regex="[0-9]+")
            with pytest.raises(grpc.RpcError) as info:
                gen.Generate(chat_request(structured=structured))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "took longer than" in info.value.details()
            error, _ = details_of(info.value)
            assert error is not None and error.metadata["param"] == "structured_output.regex"
        h.assert_idle()
    finally:
        h.stop()
