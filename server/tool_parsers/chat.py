"""Chat messages with tools, tool calls and tool results -> what a chat template renders.

A template that knows tools (it mentions ``tools``: Qwen2.5/3, Llama 3.1+, Hermes) gets the
OpenAI-shaped messages and ``tools`` as they are (tool-call arguments as objects, as HF
templates expect). A template that does not (SmolLM2's) would silently drop them, so they are
written into the conversation in the Hermes format instead: the tools as a ``<tools>`` block
in the system message, an assistant's calls as ``<tool_call>`` blocks, a tool's answer as a
user ``<tool_response>`` (around a tool's image parts too) — the convention the ``hermes``
parser reads back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tokenwire.server.tool_parsers.tool_choice import FunctionSpec

Message = dict[str, Any]

_HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_knows_tools(template: str | Mapping[str, str] | None) -> bool:
    if template is None:
        return False
    texts = [template] if isinstance(template, str) else list(template.values())
    return any("tools" in text for text in texts)


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: left as the client sent it


def render_messages(
    messages: Sequence[Message],
    tools: Sequence[FunctionSpec],
    template: str | Mapping[str, str] | None,
) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """(messages, tools) to hand to ``apply_chat_template``; tools None when there are none
    or the template does not take them."""
    if template_knows_tools(template):
        native = [_native(m) for m in messages]
        return native, [t.openai() for t in tools] or None
    out = [_hermes(m) for m in messages]
    if tools:
        block = _HERMES_SYSTEM.format(tools="\n".join(json.dumps(t.openai()) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


def _native(message: Message) -> Message:
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    converted = [
        {
            "id": c["id"],
            "type": "function",
            "function": {
                "name": c["function"]["name"],
                "arguments": _arguments_object(c["function"]["arguments"]),
            },
        }
        for c in calls
    ]
    return {**message, "tool_calls": converted}


def _hermes(message: Message) -> Message:
    role, content = message["role"], message.get("content") or ""
    if role == "tool" and isinstance(content, list):  # text and image parts, kept in order
        head, tail = "<tool_response>\n", "\n</tool_response>"
        wrapped = [{"type": "text", "text": head}, *content, {"type": "text", "text": tail}]
        return {"role": "user", "content": wrapped}
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls") or []
    if not calls:
        return {"role": role, "content": content}
    blocks = [
        "<tool_call>\n"
        + json.dumps(
            {
                "name": c["function"]["name"],
                "arguments": _arguments_object(c["function"]["arguments"]),
            }
        )
        + "\n</tool_call>"
        for c in calls
    ]
    text = "\n".join(([content] if content else []) + blocks)
    return {"role": role, "content": text}
