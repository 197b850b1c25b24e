"""Chat tools and output shaping between ``tokenwire.v1`` and the runtime's tool parsers.

In: ``ChatInput.tools`` / ``tool_choice`` / ``parallel_tool_calls`` and the messages' tool
calls and tool results -> ``ChatTooling`` (function specs, the choice, the grammar that
enforces ``required`` or a named function, and how to parse the output). Out: parsed
reasoning, content and tool calls -> ``Choice`` fields and ``TokenDelta`` pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenwire.runtime.errors import ParameterError, clip
from tokenwire.runtime.sampling_params import StructuredOutputsParams
from tokenwire.server.grpc.images import message_content
from tokenwire.server.tool_parsers.output import OutputParsing
from tokenwire.server.tool_parsers.tool_choice import (
    FunctionSpec,
    ToolChoice,
    ToolMode,
    parse_parameters,
)
from tokenwire.server.tool_parsers.types import ToolCallInfo, ToolCallPiece
from tokenwire.v1 import common_pb2

ROLES = ("system", "user", "assistant", "tool")
_MODES: dict[int, ToolMode] = {
    common_pb2.TOOL_CHOICE_MODE_NONE: "none",
    common_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    common_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}


@dataclass(frozen=True, slots=True)
class ChatTooling:
    """``tools`` are what the template shows (none for ``tool_choice`` none)."""

    tools: list[FunctionSpec]
    choice: ToolChoice | None
    constraint: StructuredOutputsParams | None
    parallel: bool
    choice_explicit: bool = False  # the client sent tool_choice (else: implied by tools)

    def parsing(self, tool_call_parser: str | None, reasoning_parser: str | None) -> OutputParsing:
        choice = self.choice
        return OutputParsing(
            reasoning_parser=reasoning_parser,
            tool_mode=None if choice is None or choice.mode == "none" else choice.mode,
            tool_call_parser=tool_call_parser,
            function=None if choice is None else choice.function,
            parallel_tool_calls=self.parallel,
            tools=tuple(self.tools),
        )


def chat_messages(chat: common_pb2.ChatInput) -> list[dict[str, Any]]:
    """The conversation as OpenAI-shaped dicts (tool calls and tool results included; a
    user message with images has a list content: ``images.message_content``)."""
    if not chat.messages:
        raise ParameterError("chat", "needs at least one message")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(chat.messages):
        if m.role not in ROLES:
            raise ParameterError(
                "chat", f"role must be system, user, assistant or tool: {clip(m.role)!r}"
            )
        message: dict[str, Any] = {"role": m.role, "content": message_content(m, i)}
        if m.tool_calls:
            if m.role != "assistant":
                raise ParameterError("chat", "only assistant messages carry tool_calls")
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in m.tool_calls
            ]
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
            if m.name:
                message["name"] = m.name
        out.append(message)
    return out


def chat_tooling(chat: common_pb2.ChatInput) -> ChatTooling:
    """Tools, the tool choice and the grammar enforcing it; errors name the proto field."""
    tools = []
    for i, tool in enumerate(chat.tools):
        fn = tool.function
        if not fn.name:
            raise ParameterError("tools", f"tool {i} has no function name")
        parameters = parse_parameters("tools", fn.parameters_json)
        tools.append(FunctionSpec(fn.name, fn.description, parameters, fn.strict))
    choice = _tool_choice(chat, bool(tools))
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    if choice is None:
        return ChatTooling(tools, None, None, parallel)
    choice.check(tools, "tool_choice")
    shown = [] if choice.mode == "none" else tools
    explicit = chat.HasField("tool_choice")
    return ChatTooling(shown, choice, choice.constraint(tools, parallel), parallel, explicit)


def _tool_choice(chat: common_pb2.ChatInput, has_tools: bool) -> ToolChoice | None:
    """The choice sent (else ``auto`` when there are tools); a choice without tools is an
    error, as at OpenAI (even ``none``)."""
    kind = chat.tool_choice.WhichOneof("choice") if chat.HasField("tool_choice") else None
    mode = _MODES.get(chat.tool_choice.mode) if kind == "mode" else None
    if kind != "function_name" and mode is None:  # unset (or UNSPECIFIED)
        return ToolChoice("auto") if has_tools else None
    if not has_tools:
        raise ParameterError("tool_choice", "is only allowed when tools are given")
    if kind == "function_name":
        return ToolChoice("named", chat.tool_choice.function_name)
    assert mode is not None
    return ToolChoice(mode)


def structured_output(message: common_pb2.StructuredOutput) -> StructuredOutputsParams | None:
    """``OutputOptions.structured_output`` -> runtime params (None when unset)."""
    kind = message.WhichOneof("kind")
    ws = message.disable_any_whitespace
    if kind is None:
        return None
    if kind == "json_schema":
        return StructuredOutputsParams(json=message.json_schema, disable_any_whitespace=ws)
    if kind == "json_object":
        if not message.json_object:
            raise ParameterError("structured_output.json_object", "must be true when set")
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=ws)
    if kind == "regex":
        return StructuredOutputsParams(regex=message.regex)
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(message.choice.choices))
    if kind == "structural_tag":
        return StructuredOutputsParams(structural_tag=message.structural_tag)
    return StructuredOutputsParams(grammar=message.grammar)


# ---------------------------------------------------------------------------- outputs
def tool_call_proto(call: ToolCallInfo) -> common_pb2.ToolCall:
    return common_pb2.ToolCall(
        id=call.id, function=common_pb2.FunctionCall(name=call.name, arguments=call.arguments)
    )


def tool_delta_proto(piece: ToolCallPiece) -> common_pb2.ToolCallDelta:
    return common_pb2.ToolCallDelta(
        index=piece.index, id=piece.id, name=piece.name, arguments=piece.arguments
    )
