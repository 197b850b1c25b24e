"""A Responses API request -> one ``tokenwire.v1.GenerateRequest`` (a chat), and the
conversation it continues.

The conversation is kept as chat messages: a stored response's history is its whole input
(the history it continued plus its own input items) followed by its output as an assistant
message (text and function calls). ``instructions`` are not part of it: as at OpenAI, each
request's own instructions become the system message in front of the history, and a
continued response's earlier instructions do not carry over.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenwire.server.rest.content_parts import image_part
from tokenwire.server.rest.errors import invalid
from tokenwire.server.rest.requests import sampling_options, stopping_options
from tokenwire.server.rest.responses_api.models import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    InputItem,
    InputText,
    MessageItem,
    ResponsesRequest,
)
from tokenwire.v1 import common_pb2, generation_pb2

_MODES = {
    "none": common_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": common_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": common_pb2.TOOL_CHOICE_MODE_REQUIRED,
}
# gRPC field names -> the Responses API's, for errors naming a field
PARAMS = {
    "request_id": "x-request-id",
    "chat": "input",
    "input": "input",
    "max_tokens": "max_output_tokens",
    "structured_output": "text.format",
    "structured_output.json_schema": "text.format.schema",
    "structured_output.json_object": "text.format",
    "chat_template_kwargs": "reasoning",
    "reasoning_effort": "reasoning.effort",
    "retain_kv_as": "store",
}


@dataclass(frozen=True)
class Translated:
    request: generation_pb2.GenerateRequest
    conversation: list[common_pb2.ChatMessage]  # history + this request's input
    named_tool: bool  # tool_choice named a function
    params: dict[str, str] = field(default_factory=dict)  # proto -> Responses API names


def _with_images(
    message: common_pb2.ChatMessage, parts: Sequence[InputText | InputImage], parts_field: str
) -> common_pb2.ChatMessage:
    """``message`` with ``parts`` in order (``input_image`` as chat's ``image_url``);
    ``parts_field``: the parts' request field (``input.<i>.content`` or ``input.<i>.output``)."""
    for j, part in enumerate(parts):
        if not isinstance(part, InputImage):
            message.parts.append(common_pb2.ContentPart(text=part.text))
            continue
        param = f"{parts_field}.{j}"
        if part.file_id is not None:
            raise invalid(
                f"{param}.file_id",
                "file_id is not supported (this server has no Files API); send the image "
                "inline as image_url, a base64 data: URL",
                "unsupported_value",
            )
        if part.image_url is None:
            raise invalid(param, "an input_image needs image_url (a base64 data: URL)")
        message.parts.append(common_pb2.ContentPart(image=image_part(part.image_url, param)))
    return message


def _message(item: MessageItem, index: int) -> common_pb2.ChatMessage:
    role = "system" if item.role == "developer" else item.role
    if not item.has_images() or isinstance(item.content, str):
        return common_pb2.ChatMessage(role=role, content=item.text())
    if role != "user":
        raise invalid(f"input.{index}.role", "only user messages can hold input_image parts")
    return _with_images(common_pb2.ChatMessage(role=role), item.content, f"input.{index}.content")


def _tool_message(item: FunctionCallOutputItem, index: int) -> common_pb2.ChatMessage:
    message = common_pb2.ChatMessage(role="tool", tool_call_id=item.call_id)
    if not item.has_images() or isinstance(item.output, str):
        message.content = item.text()
        return message
    return _with_images(message, item.output, f"input.{index}.output")


def input_messages(
    items: str | Sequence[InputItem],
) -> tuple[list[common_pb2.ChatMessage], dict[int, str]]:
    """Input items as chat messages: function calls join the assistant message before
    them (or start one), outputs become tool messages, reasoning items are dropped. With
    them, the request field of each message's parts holding images (by message index:
    ``input.<i>.content``, a function call output's ``input.<i>.output``), for errors."""
    if isinstance(items, str):
        return [common_pb2.ChatMessage(role="user", content=items)], {}
    messages: list[common_pb2.ChatMessage] = []
    image_items: dict[int, str] = {}
    for index, item in enumerate(items):
        if isinstance(item, MessageItem):
            if item.has_images():
                image_items[len(messages)] = f"input.{index}.content"
            messages.append(_message(item, index))
        elif isinstance(item, FunctionCallItem):
            if not messages or messages[-1].role != "assistant":
                messages.append(common_pb2.ChatMessage(role="assistant"))
            call = common_pb2.FunctionCall(name=item.name, arguments=item.arguments)
            messages[-1].tool_calls.append(common_pb2.ToolCall(id=item.call_id, function=call))
        elif isinstance(item, FunctionCallOutputItem):
            if item.has_images():
                image_items[len(messages)] = f"input.{index}.output"
            messages.append(_tool_message(item, index))
    if not messages:
        raise invalid("input", "input needs at least one message or function_call_output")
    return messages, image_items


def _part_params(
    messages: Sequence[common_pb2.ChatMessage], image_items: dict[int, str], offset: int
) -> dict[str, str]:
    """``chat.messages[i].parts[j]`` (the gRPC server's names) -> ``input.k.content.j``
    (``input.k.output.j`` for a function call output)."""
    params: dict[str, str] = {}
    for at, parts_field in image_items.items():
        for j in range(len(messages[at].parts)):
            param = f"{parts_field}.{j}"
            params[f"chat.messages[{offset + at}].parts[{j}]"] = param
            params[f"chat.messages[{offset + at}].parts[{j}].image"] = param
    return params


def _tools(body: ResponsesRequest, chat: common_pb2.ChatInput) -> bool:
    for tool in body.tools or ():
        chat.tools.append(
            common_pb2.Tool(
                function=common_pb2.FunctionDefinition(
                    name=tool.name,
                    description=tool.description or "",
                    parameters_json="" if tool.parameters is None else json.dumps(tool.parameters),
                    strict=bool(tool.strict),
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
    chat.tool_choice.function_name = choice.name
    return True


def _structured(body: ResponsesRequest) -> common_pb2.StructuredOutput | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if fmt.schema_ is None or not fmt.name:
        raise invalid("text.format", "a json_schema format needs name and schema")
    return common_pb2.StructuredOutput(json_schema=json.dumps(fmt.schema_))


def translate(
    body: ResponsesRequest,
    history: Sequence[common_pb2.ChatMessage],
    retain_as: str | None,
) -> Translated:
    """``history``: the continued response's conversation (empty for a new one);
    ``retain_as``: keep the KV blocks under this key (a stored response)."""
    messages, image_items = input_messages(body.input)
    conversation = [*history, *messages]
    chat = common_pb2.ChatInput(
        reasoning_effort=body.reasoning.effort or "" if body.reasoning is not None else ""
    )
    if body.instructions:
        chat.messages.append(common_pb2.ChatMessage(role="system", content=body.instructions))
    chat.messages.extend(conversation)
    named = _tools(body, chat)
    request = generation_pb2.GenerateRequest(
        model=body.model,
        chat=chat,
        sampling=sampling_options(body),
        stopping=stopping_options(body, body.max_output_tokens),
        output=common_pb2.OutputOptions(structured_output=_structured(body)),
        cache_salt=body.cache_salt or "",
        priority=body.priority,
        retain_kv_as=retain_as or "",
    )
    offset = len(history) + (1 if body.instructions else 0)
    params = {**PARAMS, **_part_params(messages, image_items, offset)}
    return Translated(request, conversation, named, params)


def output_message(
    choice_text: str, calls: Sequence[common_pb2.ToolCall]
) -> common_pb2.ChatMessage:
    """The assistant message a response adds to its conversation."""
    return common_pb2.ChatMessage(role="assistant", content=choice_text, tool_calls=calls)
