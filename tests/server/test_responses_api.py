"""The OpenAI Responses API through the real ``openai`` SDK against the real shim and gRPC
server: plain, streamed (OpenAI's event types in order), ``text.format`` json_schema, a
function-tool round trip, ``previous_response_id`` continuing a stored conversation with
``cached_tokens`` showing the KV reuse, the per-key store (404s, delete, bounds) and the
engine idle with every KV block free once the stored responses are gone.

A tiny random model with the default model's tokenizer and chat template: the grammar alone
shapes structured answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from rest_harness import RestHarness
from server_harness import MODEL_NAME, ServerHarness

from tokenwire.server.rest.responses_api.store import ResponsesSettings

KEYS = ("key-one", "key-two")
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Forecast for a city",
    "parameters": CITY,
}


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512, api_keys=KEYS, tool_call_parser="hermes", in_process=True)


@pytest.fixture(scope="module")
def rest(harness: ServerHarness) -> Iterator[RestHarness]:
    r = RestHarness(harness, responses=ResponsesSettings(max_count=4)).start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def other(rest: RestHarness) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{rest.url}/v1", api_key=KEYS[1], max_retries=0) as c:
        yield c


def create(openai_client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("max_output_tokens", 12)
    kwargs.setdefault("temperature", 0.0)
    return openai_client.responses.create(model=MODEL_NAME, **kwargs)


def forget(openai_client: openai.OpenAI, *responses: Any) -> None:
    for r in responses:
        openai_client.responses.delete(r.id)


def test_plain_matches_chat_and_is_stored(
    openai_client: openai.OpenAI, other: openai.OpenAI
) -> None:
    r = create(openai_client, input="What is the capital of France?", instructions="Be brief.")
    chat = openai_client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_tokens=12,
        temperature=0.0,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.instructions == "Be brief."
    got = openai_client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.status == r.status
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)  # another key never sees it
    openai_client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(r.id)


def test_streamed_events_in_openai_order(openai_client: openai.OpenAI) -> None:
    unary = create(openai_client, input="Say something.", store=False)
    events = list(create(openai_client, input="Say something.", stream=True, store=False))
    types = [e.type for e in events]
    assert types[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-4:-1] == tail
    assert types[-1] in ("response.completed", "response.incomplete")
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == unary.output_text
    assert events[0].response.status == "in_progress" and final.status == unary.status
    assert final.usage.input_tokens == unary.usage.input_tokens


def test_sdk_stream_helper_accumulates_the_same_response(openai_client: openai.OpenAI) -> None:
    """The SDK's ``responses.stream`` state machine accepts the events and rebuilds the
    response (it raises on an event it does not expect for the item at hand). It needs a
    ``response.completed``: the grammar ends these answers before ``max_output_tokens``."""
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    kwargs: dict[str, Any] = {"input": "Which city?", "max_output_tokens": 60, "store": False}
    unary = create(openai_client, text=fmt, **kwargs)
    with openai_client.responses.stream(
        model=MODEL_NAME, temperature=0.0, text=fmt, **kwargs
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == unary.output_text
    with openai_client.responses.stream(
        model=MODEL_NAME,
        input="Weather in Oslo?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        store=False,
    ) as stream:
        called = stream.get_final_response()
    assert called.output[0].type == "function_call"
    jsonschema.validate(json.loads(called.output[0].arguments), CITY)


def test_json_schema_format(openai_client: openai.OpenAI) -> None:
    r = create(
        openai_client,
        input="Which city?",
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        store=False,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema"


def test_function_tool_round_trip_reuses_the_kv(openai_client: openai.OpenAI) -> None:
    first = create(
        openai_client,
        input="What is the weather in Oslo?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), CITY)
    second = create(
        openai_client,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}],
        tools=[WEATHER],
    )
    assert second.previous_response_id == first.id
    assert second.output[0].type == "message"
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= 16 * (first.usage.input_tokens // 16) > 0
    forget(openai_client, first, second)


def test_streamed_function_call_arguments(openai_client: openai.OpenAI) -> None:
    events = list(
        create(
            openai_client,
            input="Weather in Paris?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=60,
            stream=True,
            store=False,
        )
    )
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "function_call" and events[2].item.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas and set(types[3:-3]) == {"response.function_call_arguments.delta"}
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[-3].arguments == "".join(deltas)
    final = events[-1].response.output
    assert final[0].type == "function_call" and final[0].arguments == "".join(deltas)
    jsonschema.validate(json.loads(final[0].arguments), CITY)


def test_continuation_prefills_only_the_new_input(openai_client: openai.OpenAI) -> None:
    first = create(openai_client, input="Tell me a story about a fox.", max_output_tokens=16)
    second = create(
        openai_client, previous_response_id=first.id, input="And then?", max_output_tokens=8
    )
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= 16 * (first.usage.input_tokens // 16) > 0
    # The same history sent in full (another cache salt: nothing shared) renders the same prompt.
    history = [
        {"role": "user", "content": "Tell me a story about a fox."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    fresh = create(
        openai_client,
        input=history,
        max_output_tokens=8,
        store=False,
        extra_body={"cache_salt": "fresh"},
    )
    assert fresh.usage.input_tokens == second.usage.input_tokens
    assert fresh.usage.input_tokens_details.cached_tokens == 0
    # Streamed continuations reuse it as well.
    events = list(
        create(openai_client, previous_response_id=second.id, input="Go on.", stream=True)
    )
    final = events[-1].response
    assert final.usage.input_tokens_details.cached_tokens >= 16 * (second.usage.input_tokens // 16)
    forget(openai_client, first, second, final)


def test_unknown_or_foreign_previous_response_is_404(
    openai_client: openai.OpenAI, other: openai.OpenAI
) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        create(openai_client, previous_response_id="resp_nope", input="hi")
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert "resp_nope" in err.value.message
    mine = create(openai_client, input="hi")
    with pytest.raises(openai.NotFoundError):
        create(other, previous_response_id=mine.id, input="hi")
    unstored = create(openai_client, input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        create(openai_client, previous_response_id=unstored.id, input="hi")
    forget(openai_client, mine)


def test_store_is_bounded_and_releases_the_kv(
    openai_client: openai.OpenAI, harness: ServerHarness
) -> None:
    made = [create(openai_client, input=f"Count to {i}.", max_output_tokens=4) for i in range(6)]
    for gone in made[:2]:  # --responses-max-stored 4: the oldest went first
        with pytest.raises(openai.NotFoundError):
            openai_client.responses.retrieve(gone.id)
    forget(openai_client, *made[2:])
    harness.assert_idle()  # no request running, no held KV block: all released


def test_cancel(openai_client: openai.OpenAI, harness: ServerHarness) -> None:
    events: list[Any] = []
    for event in create(
        openai_client, input="Write a long essay.", max_output_tokens=400, stream=True
    ):
        events.append(event)
        deltas = [e.type for e in events].count("response.output_text.delta")
        if deltas == 1 and event.type == "response.output_text.delta":
            cancelled = openai_client.responses.cancel(events[0].response.id)
            assert cancelled.status == "cancelled"
    final = events[-1].response
    assert final.status == "cancelled" and final.usage.output_tokens < 400
    assert openai_client.responses.retrieve(final.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.cancel(final.id)  # not in progress any more
    forget(openai_client, final)
    harness.assert_idle()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_bad_fields_are_400_naming_them(
    rest: RestHarness, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2, **extra}
    reply = httpx.post(
        f"{rest.url}/v1/responses",
        json=body,
        headers={"authorization": f"Bearer {KEYS[0]}"},
        timeout=60,
    )
    assert reply.status_code == 400, reply.text
    named = reply.json()["error"]["param"]
    assert named == param or named.startswith((f"{param}.", f"{param}[")), reply.text


def test_get_delete_need_a_valid_key(rest: RestHarness, openai_client: openai.OpenAI) -> None:
    r = create(openai_client, input="hi", max_output_tokens=2)
    for method in ("GET", "DELETE"):
        reply = httpx.request(
            method,
            f"{rest.url}/v1/responses/{r.id}",
            headers={"authorization": "Bearer wrong"},
            timeout=60,
        )
        assert reply.status_code == 401, reply.text
    deleted = httpx.delete(
        f"{rest.url}/v1/responses/{r.id}",
        headers={"authorization": f"Bearer {KEYS[0]}"},
        timeout=60,
    )
    assert deleted.json() == {"id": r.id, "object": "response", "deleted": True}
