"""Response objects and output items of the Responses API (plain JSON-ready dicts).

A choice becomes, in order: a ``reasoning`` item (with a reasoning parser, when the model
reasoned), a ``message`` item with one ``output_text`` part (when there is text, or nothing
else), and one ``function_call`` item per tool call. Status: a choice cut by
``max_output_tokens`` or the context is ``incomplete`` (``incomplete_details.reason``
"max_output_tokens"), a cancelled one ``cancelled``, else ``completed``. The items still
open when a choice is cut (its function calls, else its message) are ``incomplete`` too.
"""

from __future__ import annotations

import uuid
from typing import Any

from tokenwire.server.rest.responses_api.models import ResponsesRequest
from tokenwire.v1 import common_pb2, generation_pb2

JSON = dict[str, Any]
_INCOMPLETE = {
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_CONTEXT_LENGTH,
    common_pb2.FINISH_REASON_TIME_LIMIT,
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(reason: int) -> str:
    if reason in _INCOMPLETE:
        return "incomplete"
    if reason == common_pb2.FINISH_REASON_CANCELLED:
        return "cancelled"
    if reason == common_pb2.FINISH_REASON_ERROR:
        return "failed"
    return "completed"


def usage_body(usage: common_pb2.Usage) -> JSON:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> JSON:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content if status != "in_progress" else [],
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> JSON:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> JSON:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(choice: generation_pb2.Choice) -> list[JSON]:
    """The choice's items; in a choice cut short the items still open when it ended (the
    function calls, else the message) are ``incomplete``, as the stream's are."""
    last = "incomplete" if status_of(choice.finish_reason) == "incomplete" else "completed"
    items: list[JSON] = []
    if choice.reasoning_content:
        items.append(reasoning_item(new_id("rs"), choice.reasoning_content))
    if choice.text or not choice.tool_calls:
        status = "completed" if choice.tool_calls else last
        items.append(message_item(new_id("msg"), choice.text, status))
    for call in choice.tool_calls:
        args = call.function.arguments
        items.append(function_call_item(new_id("fc"), call.id, call.function.name, args, last))
    return items


def response_object(
    response_id: str,
    created: int,
    body: ResponsesRequest,
    model: str,
    status: str,
    output: list[JSON],
    usage: JSON | None,
) -> JSON:
    """OpenAI's Response object for ``body`` (echoing the request's settings)."""
    tool_choice: Any = body.tool_choice or "auto"
    if not isinstance(tool_choice, str):
        tool_choice = {"type": "function", "name": tool_choice.name}
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    text_format = fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model or body.model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "store": body.store is not False,
        "temperature": body.temperature,
        "text": {"format": text_format},
        "tool_choice": tool_choice,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": body.user,
        "metadata": body.metadata or {},
    }


def output_text(items: list[JSON]) -> str:
    """The text of the message items (what a continuation's assistant message holds)."""
    return "".join(
        part["text"]
        for item in items
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


def output_calls(items: list[JSON]) -> list[common_pb2.ToolCall]:
    return [
        common_pb2.ToolCall(
            id=item["call_id"],
            function=common_pb2.FunctionCall(name=item["name"], arguments=item["arguments"]),
        )
        for item in items
        if item["type"] == "function_call"
    ]
