"""Defects of streamed and cut-off tool calls, through the real ``openai`` SDK against the
real shim (and the gRPC stream beneath it).

#12: every chunk carries at most one delta per call index; a call's first delta carries id,
type and name, later ones only index and an arguments fragment; no chunk of a tool-call
stream is an empty ``content: ""`` delta. Checked for a named tool choice, ``required``
and ``auto`` (calls parsed from the model's text) and for gRPC's ``TokenDelta.tool_calls``.
instructor's partial-streaming mode reads ``delta.tool_calls[0].function.arguments`` of
each chunk; those fragments must add up to the call's whole arguments.

#22: a named or required tool choice cut off by ``max_tokens`` returns no tool call and
``finish_reason: "length"`` (unary); a stream ends with ``"length"`` too.

A tiny random model with the default model's tokenizer: the grammar alone shapes answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from server_harness import MODEL_NAME, ServerHarness

from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["city", "days"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER_PARAMS},
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Local time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
HERMES_TWO_CALLS = (
    'Looking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512, tool_call_parser="hermes")


def chat(openai_client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 200)
    kwargs.setdefault("seed", 1)
    return openai_client.chat.completions.create(model=MODEL_NAME, **kwargs)


def _openai_shaped(stream: Any) -> tuple[dict[int, dict[str, str]], str, str | None]:
    """Checks each chunk of a tool-call stream as OpenAI shapes it; returns the calls (by
    index), what instructor's partial mode reads, and the finish reason."""
    calls: dict[int, dict[str, str]] = {}
    instructor, finish = "", None
    for number, chunk in enumerate(stream):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        pieces = delta.tool_calls or []
        if number > 0:  # after the role chunk: something to say in every chunk
            assert pieces or delta.content or choice.finish_reason, chunk.model_dump()
        indexes = [p.index for p in pieces]
        assert len(indexes) == len(set(indexes)), f"two deltas of one call: {chunk.model_dump()}"
        for piece in pieces:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = {"name": piece.function.name, "args": ""}
            else:
                assert piece.id is None and piece.type is None and piece.function.name is None
            calls[piece.index]["args"] += piece.function.arguments or ""
        if pieces and pieces[0].function and pieces[0].function.arguments:
            instructor += pieces[0].function.arguments  # instructor's extract_json
        finish = choice.finish_reason or finish
    return calls, instructor, finish


def test_named_tool_choice_streams_like_openai(openai_client: openai.OpenAI) -> None:
    for seed in (1, 2):
        stream = chat(openai_client, tools=[WEATHER], tool_choice=NAMED, stream=True, seed=seed)
        calls, instructor, finish = _openai_shaped(stream)
        assert finish == "stop" and list(calls) == [0]
        assert calls[0]["name"] == "get_weather"
        assert instructor == calls[0]["args"] and instructor.startswith("{")
        jsonschema.validate(json.loads(instructor), WEATHER_PARAMS)


def test_required_tool_choice_streams_like_openai(openai_client: openai.OpenAI) -> None:
    stream = chat(openai_client, tools=[WEATHER, CLOCK], tool_choice="required", stream=True)
    calls, _, finish = _openai_shaped(stream)
    assert finish == "tool_calls" and calls
    unary = chat(openai_client, tools=[WEATHER, CLOCK], tool_choice="required").choices[0].message
    expected = [(c.function.name, c.function.arguments) for c in unary.tool_calls]
    assert [(c["name"], c["args"]) for c in calls.values()] == expected


def test_auto_tool_calls_stream_like_openai(openai_client: openai.OpenAI) -> None:
    extra = {"guided_choice": [HERMES_TWO_CALLS]}
    stream = chat(openai_client, tools=[WEATHER, CLOCK], extra_body=extra, stream=True)
    calls, _, finish = _openai_shaped(stream)
    assert finish == "tool_calls"
    assert [(c["name"], c["args"]) for c in calls.values()] == [
        ("get_weather", '{"city": "Oslo", "days": 3}'),
        ("get_time", "{}"),
    ]


def _grpc_request(**chat: Any) -> generation_pb2.GenerateRequest:
    structured = chat.pop("structured", None)
    return generation_pb2.GenerateRequest(
        chat=common_pb2.ChatInput(
            messages=[common_pb2.ChatMessage(role="user", content="Weather?")], **chat
        ),
        sampling=common_pb2.SamplingOptions(temperature=1.0, seed=3),
        stopping=common_pb2.StoppingOptions(max_tokens=200),
        output=common_pb2.OutputOptions(structured_output=structured),
    )


def test_grpc_stream_sends_one_piece_per_call_per_delta(harness: ServerHarness) -> None:
    tools = [
        common_pb2.Tool(
            function=common_pb2.FunctionDefinition(
                name="get_weather", parameters_json=json.dumps(WEATHER_PARAMS)
            )
        ),
        common_pb2.Tool(function=common_pb2.FunctionDefinition(name="get_time")),
    ]
    choices = [
        common_pb2.ToolChoice(function_name="get_weather"),
        common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED),
        common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_AUTO),
    ]
    hermes = common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=[HERMES_TWO_CALLS]))
    with harness.channel() as channel:
        gen = generation_pb2_grpc.GenerationServiceStub(channel)
        for choice in choices:
            auto = choice.mode == common_pb2.TOOL_CHOICE_MODE_AUTO
            request = _grpc_request(
                tools=tools, tool_choice=choice, structured=hermes if auto else None
            )
            seen: set[int] = set()
            for event in gen.GenerateStream(request):
                pieces = event.delta.tool_calls
                assert len({p.index for p in pieces}) == len(pieces), (choice, pieces)
                for piece in pieces:
                    first = piece.index not in seen
                    assert bool(piece.id) == first and bool(piece.name) == first, piece
                    seen.add(piece.index)
            assert seen, choice
    harness.assert_idle()


# ---------------------------------------------------------------------------- #22
@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_cut_off_forced_call_is_no_call(
    harness: ServerHarness, openai_client: openai.OpenAI, tool_choice: Any
) -> None:
    """Cut at several lengths: whenever the streamed call's arguments are incomplete JSON,
    the unary answer has no call; any call it does return has complete arguments."""
    cut_inside = 0
    for max_tokens in range(2, 20, 3):
        kwargs = {"tools": [WEATHER], "tool_choice": tool_choice, "max_tokens": max_tokens}
        calls, _, finish = _openai_shaped(chat(openai_client, stream=True, **kwargs))
        choice = chat(openai_client, **kwargs).choices[0]
        if finish != "length":
            break
        assert choice.finish_reason == "length"
        for call in choice.message.tool_calls or ():
            json.loads(call.function.arguments)  # complete, or not returned at all
        if calls and not _is_json(calls[0]["args"]):
            cut_inside += 1
            assert choice.message.tool_calls is None, (max_tokens, choice.message)
    assert cut_inside > 0
    harness.assert_idle()


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_grpc_cut_off_forced_call_is_no_call(harness: ServerHarness) -> None:
    tools = [
        common_pb2.Tool(
            function=common_pb2.FunctionDefinition(
                name="get_weather", parameters_json=json.dumps(WEATHER_PARAMS)
            )
        )
    ]
    with harness.channel() as channel:
        gen = generation_pb2_grpc.GenerationServiceStub(channel)
        for choice in (
            common_pb2.ToolChoice(function_name="get_weather"),
            common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED),
        ):
            request = _grpc_request(tools=tools, tool_choice=choice)
            request.stopping.max_tokens = 2
            (answer,) = gen.Generate(request).choices
            assert answer.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert not answer.tool_calls, answer
    harness.assert_idle()
