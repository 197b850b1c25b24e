"""``tool_choice: "auto"`` with constrained arguments: a structural tag per call format.

The model writes what it likes until it opens a call with its parser's begin marker (the
tag's trigger); from there the grammar holds it to one of the tools: the rest of that
format's header with the function's name, arguments that match the function's parameters
schema (blanks one at a time, as ``json.dumps`` writes them), and the format's closing
text; then free text again (at most one call when parallel tool calls are off: the output
ends after it). The tag writes the header exactly as the parser reads it, so every
constrained call parses. Formats with a begin marker that opens one call: ``hermes``
(``<tool_call>`` + JSON), ``qwen3_coder`` (``<tool_call>`` + ``<function=...>`` XML,
xgrammar's ``qwen_xml`` style), ``deepseek_v3`` / ``deepseek_v31``
(``<｜tool▁call▁begin｜>``). Others (JSON arrays after a marker, pythonic lists, Harmony
channels) get no constraint: None.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from tokenwire.runtime.sampling_params import StructuredOutputsParams
from tokenwire.server.tool_parsers.tool_choice import FunctionSpec

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_DS_CALL, _DS_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _hermes(name: str) -> tuple[str, str]:
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ', "}\n</tool_call>"


def _qwen3_coder(name: str) -> tuple[str, str]:
    return f"<tool_call>\n<function={name}>\n", "</function>\n</tool_call>"


def _deepseek_v3(name: str) -> tuple[str, str]:
    return f"{_DS_CALL}function{_DS_SEP}{name}\n```json\n", f"\n```{_DS_END}"


def _deepseek_v31(name: str) -> tuple[str, str]:
    return f"{_DS_CALL}{name}{_DS_SEP}", _DS_END


# parser -> (trigger, tool name -> (begin, end), the arguments' style)
_SHAPES: dict[str, tuple[str, Callable[[str], tuple[str, str]], str]] = {
    "hermes": ("<tool_call>", _hermes, "json"),
    "qwen3_coder": ("<tool_call>", _qwen3_coder, "qwen_xml"),
    "deepseek_v3": (_DS_CALL, _deepseek_v3, "json"),
    "deepseek_v31": (_DS_CALL, _deepseek_v31, "json"),
}
CONSTRAINED_PARSERS = frozenset(_SHAPES)


def structural_tag(parser: str, tools: Sequence[FunctionSpec], parallel: bool) -> dict[str, Any]:
    """The structural tag (xgrammar's current shape) for ``parser``'s calls of ``tools``."""
    trigger, tag_text, style = _SHAPES[parser]
    tags = []
    for tool in tools:
        begin, end = tag_text(tool.name)
        content = {
            "type": "json_schema",
            "json_schema": tool.parameters or _NO_PARAMETERS,
            "style": style,
            "max_whitespace_cnt": 1,  # single blanks, as json.dumps writes a call
        }
        tags.append({"type": "tag", "begin": begin, "content": content, "end": end})
    fmt: dict[str, Any] = {"type": "triggered_tags", "triggers": [trigger], "tags": tags}
    if not parallel:
        fmt["stop_after_first"] = True
    return {"type": "structural_tag", "format": fmt}


def auto_constraint(
    parser: str | None, tools: Sequence[FunctionSpec], parallel: bool
) -> StructuredOutputsParams | None:
    """The constraint of an ``auto`` tool choice read by ``parser`` (None: none applies)."""
    if parser not in _SHAPES or not tools:
        return None
    return StructuredOutputsParams(structural_tag=structural_tag(parser, tools, parallel))
