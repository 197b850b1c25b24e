"""``qwen3_coder`` tool-call parser: Qwen3-Coder's XML calls.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text (one leading and one trailing newline dropped) converted by
the tool's parameters schema, as vLLM's ``qwen3_coder`` parser does: ``string`` stays text,
``integer`` / ``number`` / ``boolean`` / ``object`` / ``array`` are read as JSON (Python
literals too), ``null`` is null, and a parameter the schema does not know stays text.
The call's name streams as soon as ``<function=name>`` is closed; each parameter streams as
one arguments piece when its ``</parameter>`` arrives (``{"city": "Paris"``, then
``, "days": 3``, then ``}``), so every piece ends on a JSON value boundary and the pieces
concatenate to ``json.dumps`` of the arguments object. Text outside ``<tool_call>`` is
content; a tag split across deltas is held back. A call whose ``<function=...>`` never
closes is given back as content; missing closing tags at the end of the output are implied.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from typing import Any

from tokenwire.server.tool_parsers.tool_choice import FunctionSpec
from tokenwire.server.tool_parsers.types import (
    IdFactory,
    ParsedDelta,
    ToolCallPiece,
    held_prefix,
    new_call_id,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def _param_types(tools: Sequence[FunctionSpec]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        props = (tool.parameters or {}).get("properties")
        out[tool.name] = props if isinstance(props, dict) else {}
    return out


def convert_value(text: str, schema: Any) -> Any:
    """A parameter's raw text as the JSON value its schema says."""
    if text.strip().lower() == "null":
        return None
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["string", "null"]: the first non-null type
        kind = next((k for k in kind if k != "null"), None)
    if kind in (None, "string", "str", "text") or not isinstance(kind, str):
        return text
    stripped = text.strip()
    if kind == "boolean":
        return {"true": True, "false": False}.get(stripped.lower(), text)
    try:
        value = json.loads(stripped)
    except ValueError:
        try:
            value = ast.literal_eval(stripped)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return text
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return text
    return value


class _Call:
    """One open ``<tool_call>``: its text so far and what of it was streamed."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.body = ""
        self.name: str | None = None
        self.scanned = 0  # body consumed up to here (function header, whole parameters)
        self.num_params = 0


class Qwen3CoderToolParser:
    def __init__(
        self,
        new_id: IdFactory = new_call_id,
        parallel: bool = True,
        tools: Sequence[FunctionSpec] = (),
    ) -> None:
        self._new_id = new_id
        self.parallel = parallel
        self._types = _param_types(tools)
        self._pending = ""
        self._call: _Call | None = None
        self._num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._pending += text
        while self._pending:
            if self._call is None:
                if not self._content(out):
                    break
            elif not self._inside(out):
                break
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._call is None:
            out.content += self._pending
        else:
            self._call.body += self._pending
            self._end_call(out, "")
        self._pending = ""
        return out

    def _content(self, out: ParsedDelta) -> bool:
        start = self._pending.find(OPEN)
        if start < 0:
            keep = held_prefix(self._pending, OPEN)
            out.content += self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep :]
            return False
        out.content += self._pending[:start]
        self._pending = self._pending[start + len(OPEN) :]
        self._call = _Call(self._num_calls)
        return True

    def _inside(self, out: ParsedDelta) -> bool:
        call = self._call
        assert call is not None
        call.body += self._pending
        self._pending = ""
        end = call.body.find(CLOSE)
        if end >= 0:
            self._pending = call.body[end + len(CLOSE) :]
            call.body = call.body[:end]
            self._end_call(out, CLOSE)
            return True
        self._advance(call, out)
        return False

    @property
    def _reporting(self) -> bool:
        return self.parallel or self._num_calls == 0

    def _emit(self, out: ParsedDelta, piece: ToolCallPiece) -> None:
        if self._reporting:
            out.tool_calls.append(piece)

    def _advance(self, call: _Call, out: ParsedDelta) -> None:
        """Stream what is complete: the name, then each closed parameter."""
        if call.name is None:
            start = call.body.find(FUNCTION)
            close = call.body.find(">", start + len(FUNCTION)) if start >= 0 else -1
            if close < 0:
                return
            name = call.body[start + len(FUNCTION) : close].strip()
            if not name:
                return
            call.name, call.scanned = name, close + 1
            self._emit(out, ToolCallPiece(call.index, self._new_id(), name))
        while True:
            start = call.body.find(PARAMETER, call.scanned)
            if start < 0:
                return
            end = call.body.find(PARAMETER_END, start)
            if end < 0:
                return
            self._parameter(call, call.body[start + len(PARAMETER) : end], out)
            call.scanned = end + len(PARAMETER_END)

    def _parameter(self, call: _Call, text: str, out: ParsedDelta) -> None:
        key, sep, value = text.partition(">")
        if not sep:
            return
        value = value.removeprefix("\n").removesuffix("\n")
        assert call.name is not None
        schema = self._types.get(call.name, {}).get(key.strip())
        piece = json.dumps(key.strip()) + ": " + json.dumps(convert_value(value, schema))
        prefix = "{" if call.num_params == 0 else ", "
        call.num_params += 1
        self._emit(out, ToolCallPiece(call.index, arguments=prefix + piece))

    def _end_call(self, out: ParsedDelta, close: str) -> None:
        call = self._call
        assert call is not None
        self._advance(call, out)
        if call.name is None:  # not a call after all: the model's text, as written
            out.content += OPEN + call.body + close
        else:
            rest = call.body[call.scanned :]
            start = rest.find(PARAMETER)
            if start >= 0:  # a parameter cut short: its text so far is its value
                tail = rest[start + len(PARAMETER) :].split(FUNCTION_END)[0]
                self._parameter(call, tail.removesuffix("\n"), out)
            self._emit(out, ToolCallPiece(call.index, arguments="}" if call.num_params else "{}"))
            self._num_calls += 1
        self._call = None
