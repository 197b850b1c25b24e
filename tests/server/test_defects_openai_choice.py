"""Defects of ``tool_choice`` checks and grammars, through the real ``openai`` SDK against the
real shim, over gRPC, and on the grammar's schema itself.

#21: ``tool_choice: "required"`` with tools whose parameters use local ``$ref`` / ``$defs``
(also two tools with same-named ``$defs``, ``definitions``, refs to ``#`` and to other
pointers) builds one schema in which every ref still means what it meant in its own tool.

#23: ``tool_choice`` without ``tools`` is a 400 naming ``tool_choice`` (as at OpenAI), and
INVALID_ARGUMENT naming it over gRPC.

A tiny random model with the default model's tokenizer: the grammar alone shapes answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from grpc_helpers import details_of
from server_harness import MODEL_NAME, ServerHarness

from tokenwire.server.tool_parsers.tool_choice import FunctionSpec, ToolChoice
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc


def _item_tool(name: str, item: dict[str, Any]) -> dict[str, Any]:
    """A tool whose one argument is defined under ``$defs/Item``."""
    parameters = {
        "type": "object",
        "properties": {"item": {"$ref": "#/$defs/Item"}},
        "required": ["item"],
        "$defs": {"Item": item},
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


ADD = _item_tool("add_item", {"type": "integer", "minimum": 1, "maximum": 9})
TAG = _item_tool("tag_item", {"type": "string", "enum": ["red", "blue"]})
MOVE = {  # draft-07 ``definitions``, a ref to a ref, and a ref into ``properties``
    "type": "function",
    "function": {
        "name": "move",
        "parameters": {
            "type": "object",
            "properties": {
                "to": {"$ref": "#/definitions/Place"},
                "back": {"$ref": "#/properties/to"},
            },
            "required": ["to", "back"],
            "definitions": {
                "Place": {"$ref": "#/definitions/City"},
                "City": {"type": "string", "enum": ["Oslo", "Lima"]},
            },
        },
    },
}
ASK = [{"role": "user", "content": "Do it."}]


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512, tool_call_parser="hermes")


def chat(openai_client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 120)
    return openai_client.chat.completions.create(model=MODEL_NAME, **kwargs)


# ---------------------------------------------------------------------------- #21
def test_required_with_defs_resolves_each_tools_refs(
    harness: ServerHarness, openai_client: openai.OpenAI
) -> None:
    tools = [ADD, TAG, MOVE]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    called = set()
    for seed in range(6):
        reply = chat(openai_client, tools=tools, tool_choice="required", seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            called.add(call.function.name)
    assert len(called) >= 2, called  # the grammar let the model pick among the tools
    # The named choice of the same tools keeps working.
    for tool in tools:
        name = tool["function"]["name"]
        named = {"type": "function", "function": {"name": name}}
        (call,) = (
            chat(openai_client, tools=tools, tool_choice=named, seed=1)
            .choices[0]
            .message.tool_calls
        )
        jsonschema.validate(json.loads(call.function.arguments), schemas[name])
    harness.assert_idle()


def _required_schema(*tools: dict[str, Any]) -> dict[str, Any]:
    specs = [FunctionSpec(t["function"]["name"], "", t["function"]["parameters"]) for t in tools]
    constraint = ToolChoice("required").constraint(specs, parallel=True)
    assert constraint is not None and isinstance(constraint.json, str)
    schema: dict[str, Any] = json.loads(constraint.json)
    return schema


def _valid(schema: dict[str, Any], instance: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_required_schema_keeps_refs_per_tool() -> None:
    schema = _required_schema(ADD, TAG, MOVE)
    ok = [
        {"name": "add_item", "parameters": {"item": 3}},
        {"name": "tag_item", "parameters": {"item": "red"}},
        {"name": "move", "parameters": {"to": "Oslo", "back": "Lima"}},
    ]
    assert _valid(schema, ok)
    for wrong in (
        {"name": "add_item", "parameters": {"item": "red"}},  # tag_item's Item
        {"name": "tag_item", "parameters": {"item": 3}},  # add_item's Item
        {"name": "move", "parameters": {"to": "Oslo", "back": "Rome"}},
    ):
        assert not _valid(schema, [wrong]), wrong


def test_required_schema_keeps_a_root_ref() -> None:
    tree = {
        "type": "function",
        "function": {
            "name": "tree",
            "parameters": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
                "required": ["kids"],
                "additionalProperties": False,
            },
        },
    }
    schema = _required_schema(tree, ADD)
    assert _valid(schema, [{"name": "tree", "parameters": {"kids": [{"kids": []}]}}])
    assert not _valid(schema, [{"name": "tree", "parameters": {"kids": [{"item": 3}]}}])


# ---------------------------------------------------------------------------- #23
@pytest.mark.parametrize(
    "kwargs",
    [
        {"tool_choice": "none"},
        {"tool_choice": "auto"},
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "add_item"}}},
        {"tool_choice": "auto", "tools": []},
    ],
)
def test_tool_choice_without_tools_is_400(
    openai_client: openai.OpenAI, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        chat(openai_client, **kwargs)
    assert bad.value.param == "tool_choice", bad.value.message
    assert "tools" in bad.value.message


def test_grpc_tool_choice_without_tools_is_invalid(harness: ServerHarness) -> None:
    with harness.channel() as channel:
        gen = generation_pb2_grpc.GenerationServiceStub(channel)
        for choice in (
            common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_NONE),
            common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_AUTO),
        ):
            request = generation_pb2.GenerateRequest(
                chat=common_pb2.ChatInput(
                    messages=[common_pb2.ChatMessage(role="user", content="Hi")],
                    tool_choice=choice,
                ),
                stopping=common_pb2.StoppingOptions(max_tokens=2),
            )
            for call in (gen.Generate, lambda r: list(gen.GenerateStream(r))):
                with pytest.raises(grpc.RpcError) as info:
                    call(request)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                error, _ = details_of(info.value)
                assert error is not None and error.metadata["param"] == "tool_choice"
    harness.assert_idle()
