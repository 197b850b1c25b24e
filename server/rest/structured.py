"""OpenAI / vLLM structured-output and tool fields -> ``tokenwire.v1`` messages.

One constraint per request, from exactly one of: ``response_format`` (``json_object``,
``json_schema``; ``text`` is none), vLLM's ``structured_outputs`` object, or its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. The returned
parameter map sends a gRPC error about ``structured_output.*`` back under the field the
client used. Tools become ``ChatInput.tools`` with their parameters schema as JSON text.
"""

from __future__ import annotations

import json
from typing import Any

from tokenwire.server.rest.errors import invalid
from tokenwire.server.rest.models import ChatCompletionRequest, CommonFields
from tokenwire.v1 import common_pb2

_SUBFIELDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
_MODES = {
    "none": common_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": common_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": common_pb2.TOOL_CHOICE_MODE_REQUIRED,
}


def _schema_text(value: dict[str, Any] | str) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _all_to(name: str) -> dict[str, str]:
    """Every structured_output error named ``name`` (the client's field)."""
    return {"structured_output": name, **{f"structured_output.{s}": name for s in _SUBFIELDS}}


def _sources(body: CommonFields) -> list[tuple[str, common_pb2.StructuredOutput]]:
    found: list[tuple[str, common_pb2.StructuredOutput]] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", common_pb2.StructuredOutput(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_ if fmt.json_schema else None
        text = _schema_text(schema if schema is not None else {"type": "object"})
        found.append(("response_format", common_pb2.StructuredOutput(json_schema=text)))
    elif fmt is not None and fmt.type == "structural_tag":
        text = _schema_text(fmt.structural_tag())
        found.append(("response_format", common_pb2.StructuredOutput(structural_tag=text)))
    so = body.structured_outputs
    if so is not None:
        message = common_pb2.StructuredOutput(
            disable_any_whitespace=bool(so.disable_any_whitespace)
        )
        if so.json_ is not None:
            message.json_schema = _schema_text(so.json_)
        if so.regex is not None:
            message.regex = so.regex
        if so.choice is not None:
            message.choice.choices.extend(so.choice)
        if so.grammar is not None:
            message.grammar = so.grammar
        if so.json_object is not None:
            message.json_object = so.json_object
        if so.structural_tag is not None:
            message.structural_tag = _schema_text(so.structural_tag)
        found.append(("structured_outputs", message))
    if body.guided_json is not None:
        text = _schema_text(body.guided_json)
        found.append(("guided_json", common_pb2.StructuredOutput(json_schema=text)))
    if body.guided_regex is not None:
        found.append(("guided_regex", common_pb2.StructuredOutput(regex=body.guided_regex)))
    if body.guided_choice is not None:
        choices = common_pb2.ChoiceList(choices=body.guided_choice)
        found.append(("guided_choice", common_pb2.StructuredOutput(choice=choices)))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", common_pb2.StructuredOutput(grammar=body.guided_grammar)))
    if body.structural_tag is not None:
        tag = common_pb2.StructuredOutput(structural_tag=body.structural_tag)
        found.append(("structural_tag", tag))
    return found


def _check_structured_outputs_fields(body: CommonFields) -> None:
    """vLLM's object takes exactly one constraint (the gRPC oneof would keep the last)."""
    so = body.structured_outputs
    if so is None:
        return
    set_fields = [
        name
        for name, value in (
            ("json", so.json_),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", so.json_object),
            ("structural_tag", so.structural_tag),
        )
        if value is not None
    ]
    if len(set_fields) != 1:
        raise invalid(
            "structured_outputs",
            "set exactly one of json, regex, choice, grammar, json_object or structural_tag",
        )


def structured_output(
    body: CommonFields,
) -> tuple[common_pb2.StructuredOutput | None, dict[str, str]]:
    """The request's one constraint (or None) and where its errors point."""
    _check_structured_outputs_fields(body)
    found = _sources(body)
    if not found:
        return None, {}
    if len(found) > 1:
        raise invalid(found[1][0], f"only one of {', '.join(n for n, _ in found)} may be set")
    name, message = found[0]
    params = _all_to(name)
    if name == "structured_outputs":
        params.update(
            {
                "structured_output.json_schema": "structured_outputs.json",
                "structured_output.json_object": "structured_outputs.json_object",
                "structured_output.regex": "structured_outputs.regex",
                "structured_output.choice": "structured_outputs.choice",
                "structured_output.grammar": "structured_outputs.grammar",
                "structured_output.structural_tag": "structured_outputs.structural_tag",
            }
        )
    return message, params


def chat_tools(body: ChatCompletionRequest, chat: common_pb2.ChatInput) -> bool:
    """Fill ``chat``'s tools, tool choice and parallel flag; True when a function is named."""
    for tool in body.tools or ():
        fn = tool.function
        parameters = "" if fn.parameters is None else json.dumps(fn.parameters)
        chat.tools.append(
            common_pb2.Tool(
                function=common_pb2.FunctionDefinition(
                    name=fn.name,
                    description=fn.description or "",
                    parameters_json=parameters,
                    strict=bool(fn.strict),
                )
            )
        )
    if body.parallel_tool_calls is not None:
        chat.parallel_tool_calls = body.parallel_tool_calls
    choice = body.tool_choice
    if choice is None:
        return False
    if isinstance(choice, str):
        chat.tool_choice.mode = _MODES[choice]
        return False
    chat.tool_choice.function_name = choice.function.name
    return True
