"""The OpenAI shim's structured outputs and tools, driven by the official ``openai`` SDK:
``response_format`` (``chat.completions.parse`` with a pydantic model), vLLM's guided_* and
``structured_outputs`` extras, tool calling round trips (required, named, auto via the
hermes parser), streamed exactly as OpenAI streams tool calls, and reasoning content.

A tiny random model with the default model's tokenizer: the grammar alone shapes answers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from rest_harness import RestHarness
from server_harness import MODEL_NAME, ServerHarness

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["city", "days"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Local time"}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=9)
    rain: bool


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512, tool_call_parser="hermes", reasoning_parser="qwen3")


def chat(openai_client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 200)
    return openai_client.chat.completions.create(model=MODEL_NAME, seed=1, **kwargs)


def test_parse_with_a_pydantic_model(harness: ServerHarness, openai_client: openai.OpenAI) -> None:
    parse = (
        getattr(openai_client.chat.completions, "parse", None)
        or openai_client.beta.chat.completions.parse
    )
    for seed in (1, 2, 3):
        reply = parse(
            model=MODEL_NAME, messages=ASK, response_format=Forecast, seed=seed, max_tokens=300
        )
        message = reply.choices[0].message
        assert isinstance(message.parsed, Forecast), message.content
        assert reply.choices[0].finish_reason == "stop"
    harness.assert_idle()


def test_response_format_and_vllm_extras(
    harness: ServerHarness, openai_client: openai.OpenAI
) -> None:
    schema = Forecast.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": schema, "strict": True}}
    text = chat(openai_client, response_format=fmt).choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    # (json_object: any object, which a random model never closes; see test_rest_openai.)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"guided_regex": r"[a-c]{4}-\d"}, r"[a-c]{4}-\d"),
        ({"guided_choice": ["left", "right"]}, r"left|right"),
        ({"guided_grammar": 'root ::= "x" [0-9]{2}'}, r"x[0-9]{2}"),
        ({"structured_outputs": {"regex": r"(yes|no)!"}}, r"(yes|no)!"),
        ({"guided_json": {"type": "integer", "minimum": 10, "maximum": 99}}, r"[1-9][0-9]"),
    ]
    for extra, pattern in cases:
        reply = chat(openai_client, extra_body=extra)
        assert re.fullmatch(pattern, reply.choices[0].message.content or ""), extra
    completion = openai_client.completions.create(
        model=MODEL_NAME, prompt="Pick:", max_tokens=20, extra_body={"guided_choice": ["a", "b"]}
    )
    assert completion.choices[0].text in ("a", "b")
    harness.assert_idle()


def grammar_end_replies(client: openai.OpenAI) -> list[tuple[str, str | None]]:
    """(text, finish_reason, completion tokens) of constraints that end without a stop token
    (``ignore_eos``, no ``stop_token_ids``): the grammar's completion ends each."""
    replies = []
    for extra in ({"guided_choice": ["alpha", "beta gamma"]}, {"guided_regex": r"(ab|cd){2}-\d"}):
        body = {**extra, "ignore_eos": True}
        reply = chat(client, extra_body=body, max_tokens=40)
        choice = reply.choices[0]
        replies.append((choice.message.content or "", choice.finish_reason))
        completion = client.completions.create(
            model=MODEL_NAME, prompt="Pick:", max_tokens=40, seed=2, extra_body=body
        )
        text = completion.choices[0].text
        replies.append((text, completion.choices[0].finish_reason))
    return replies


def test_grammar_end_keeps_the_last_token_sync_and_async(
    harness: ServerHarness, openai_client: openai.OpenAI, harness_model: Path
) -> None:
    """The last token of a grammar that ends without a stop token is content: the text keeps
    it ("alpha", never "alph") and finish_reason is "stop" (as vLLM reports for a grammar that
    ended), with async scheduling on and off, token for token the same."""
    sync = grammar_end_replies(openai_client)
    fast_server = ServerHarness(harness_model, max_model_len=512, async_scheduling=True).start()
    try:
        fast_rest = RestHarness(fast_server).start()
        try:
            with openai.OpenAI(base_url=f"{fast_rest.url}/v1", api_key="x", max_retries=0) as c:
                fast = grammar_end_replies(c)
        finally:
            fast_rest.stop()
        fast_server.assert_idle()
    finally:
        fast_server.stop()
    assert fast == sync
    patterns = [r"alpha|beta gamma"] * 2 + [r"(ab|cd){2}-\d"] * 2
    for (text, finish), pattern in zip(sync, patterns, strict=True):
        assert re.fullmatch(pattern, text), sync
        assert finish == "stop", sync
    harness.assert_idle()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"guided_json": '{"type": "object", "properties": ['}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
        ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_invalid_constraint_is_400_naming_the_field(
    openai_client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        chat(openai_client, extra_body=extra)
    assert bad.value.param == param, bad.value.message


def _stream_calls(stream: Any) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """Content, accumulated calls and the finish reason of a streamed chat; checks that
    each call's first piece carries id, type and name, and later pieces only arguments."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or ():
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "args": ""}
            else:
                assert piece.id is None and piece.function.name is None
            calls[piece.index]["args"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_tool_round_trip_required(harness: ServerHarness, openai_client: openai.OpenAI) -> None:
    reply = chat(
        openai_client, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(args, WEATHER["function"]["parameters"])
    else:
        assert args == {}
    # The same request streamed: the pieces add up to the unary call.
    stream = chat(
        openai_client,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        parallel_tool_calls=False,
        stream=True,
    )
    content, calls, finish = _stream_calls(stream)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["args"]) for c in calls.values()] == [
        (call.function.name, call.function.arguments)
    ]
    # Send the result back: the history carries the call and the tool's answer.
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 12}'},
    ]
    final = chat(
        openai_client, messages=history, tools=[WEATHER, CLOCK], tool_choice="none", max_tokens=8
    )
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].finish_reason in ("stop", "length")
    plain = chat(openai_client, max_tokens=1).usage.prompt_tokens  # the question alone
    assert final.usage.prompt_tokens > plain + 20  # + the call and the tool's answer
    harness.assert_idle()


def test_named_and_auto_tool_choice_with_reasoning(
    harness: ServerHarness, openai_client: openai.OpenAI
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = chat(openai_client, tools=[WEATHER], tool_choice=named)
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # auto: the (grammar-steered) model thinks, then writes a Hermes call in its text.
    answer = (
        "<think>Oslo it is.</think>\nLet me look.<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
    )
    kwargs: dict[str, Any] = {"tools": [WEATHER], "extra_body": {"guided_choice": [answer]}}
    reply = chat(openai_client, **kwargs)
    message = reply.choices[0].message
    assert message.content == "Let me look." and reply.choices[0].finish_reason == "tool_calls"
    assert message.model_extra is not None
    assert message.model_extra["reasoning_content"] == "Oslo it is."
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city": "Oslo", "days": 3}')
    ]
    content, calls, finish = _stream_calls(chat(openai_client, stream=True, **kwargs))
    assert (content, finish) == ("Let me look.", "tool_calls")
    assert [(c["name"], c["args"]) for c in calls.values()] == [
        ("get_weather", '{"city": "Oslo", "days": 3}')
    ]
    harness.assert_idle()


def test_invalid_tools_are_400(openai_client: openai.OpenAI) -> None:
    for kwargs, param in (
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            chat(openai_client, **kwargs)
        assert bad.value.param == param, (kwargs, bad.value.message)
