"""Units of the Responses API: the stream's event order for reasoning, text and a function
call (what a reasoning parser and a tool parser produce), unary output items, the owner
digest and the store's bounds (count, bytes, age)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tokenwire.server.rest.responses_api.events import ResponseEvents
from tokenwire.server.rest.responses_api.output import output_items
from tokenwire.server.rest.responses_api.store import (
    ResponsesSettings,
    ResponseStore,
    StoredResponse,
    owner_of,
)
from tokenwire.v1 import common_pb2, generation_pb2


def _build(status: str, items: list[Any], usage: Any) -> dict[str, Any]:
    return {"status": status, "output": list(items), "usage": usage}


def _events(raw: bytes) -> list[dict[str, Any]]:
    found = re.findall(r"event: (\S+)\ndata: (.*)\n\n", raw.decode())
    for kind, data in found:
        assert json.loads(data)["type"] == kind
    return [json.loads(data) for _, data in found]


def test_reasoning_text_and_call_events_in_order() -> None:
    ev = ResponseEvents(_build)
    call = common_pb2.ToolCallDelta
    raw = (
        ev.start()
        + ev.on_delta(generation_pb2.TokenDelta(reasoning_text="think"))
        + ev.on_delta(generation_pb2.TokenDelta(reasoning_text="ing", text="Hel"))
        + ev.on_delta(generation_pb2.TokenDelta(text="lo"))
        + ev.on_delta(
            generation_pb2.TokenDelta(
                tool_calls=[call(index=0, id="call_1", name="f", arguments='{"a"')]
            )
        )
        + ev.on_delta(generation_pb2.TokenDelta(tool_calls=[call(index=0, arguments=":1}")]))
        + ev.on_end(generation_pb2.ChoiceEnd(finish_reason=common_pb2.FINISH_REASON_EOS))
        + ev.finish(common_pb2.Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=1))
    )
    events = _events(raw)
    item = ["response.output_item.added", "response.content_part.added"]
    close = ["response.content_part.done", "response.output_item.done"]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        *item,
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        *close,
        *item,
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        *close,
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "thinking"
    assert final["output"][1]["content"][0]["text"] == "Hello"
    assert (
        final["output"][2]["arguments"] == '{"a":1}' and final["output"][2]["call_id"] == "call_1"
    )
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 1
    assert final["status"] == "completed"
    indexes = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert indexes == [0, 1, 2]


def test_cut_by_max_output_tokens_is_incomplete() -> None:
    ev = ResponseEvents(_build)
    raw = ev.start() + ev.on_delta(generation_pb2.TokenDelta(text="a"))
    raw += ev.on_end(generation_pb2.ChoiceEnd(finish_reason=common_pb2.FINISH_REASON_LENGTH))
    raw += ev.finish(common_pb2.Usage(prompt_tokens=1, completion_tokens=1))
    events = _events(raw)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"


def test_unary_output_items() -> None:
    choice = generation_pb2.Choice(text="t", reasoning_content="r")
    choice.tool_calls.append(
        common_pb2.ToolCall(id="call_9", function=common_pb2.FunctionCall(name="f", arguments="{}"))
    )
    items = output_items(choice)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    only_call = generation_pb2.Choice(tool_calls=choice.tool_calls)
    assert [i["type"] for i in output_items(only_call)] == ["function_call"]
    assert [i["type"] for i in output_items(generation_pb2.Choice())] == ["message"]


def test_owner_is_a_digest() -> None:
    assert owner_of(None) == "anon" and owner_of("") == "anon"
    assert owner_of("Bearer k1") != owner_of("Bearer k2")
    assert "k1" not in owner_of("Bearer k1")


def _record(rid: str, text: str = "x") -> StoredResponse:
    return StoredResponse(rid, rid, {"status": "completed", "output": text}, [])


def test_store_bounds_count_bytes_and_age() -> None:
    now = [0.0]
    store = ResponseStore(
        ResponsesSettings(max_count=2, max_bytes=400, max_age=10.0), lambda: now[0]
    )
    assert store.put("a", _record("r1")) == []
    assert store.put("a", _record("r2")) == []
    assert [r.id for r in store.put("a", _record("r3"))] == ["r1"]  # count
    assert store.put("b", _record("r1")) == []  # owners are separate
    assert store.get("a", "r1") is None and store.get("b", "r1") is not None
    assert [r.id for r in store.put("a", _record("big", "y" * 360))] == ["r2", "r3"]  # bytes
    assert [r.id for r in store.put("a", _record("huge", "z" * 1000))] == ["big", "huge"]
    assert store.put("a", _record("r4")) == []
    now[0] = 11.0
    assert [r.id for r in store.expire("a")] == ["r4"]  # age: returned to release its KV
    assert store.get("b", "r1") is None  # another owner's: forgotten by the same sweep
    assert store.count("a") == 0 and store.count("b") == 0
    with pytest.raises(ValueError, match="--responses-max-age"):
        ResponsesSettings(max_age=0)
