"""Parsers for output whose shape a grammar forced (``tool_choice`` required or named).

``required``: the output is a JSON array of ``{"name", "parameters"}`` objects (vLLM's
approach: one schema for every tool, independent of the model's own call format).
Elements are found with a small JSON scanner (depth and string state) and each is read with
``CallBody`` as it streams. Named: the output *is* the arguments object of that function.
"""

from __future__ import annotations

import json

from tokenwire.server.tool_parsers.call_body import CallBody
from tokenwire.server.tool_parsers.types import (
    IdFactory,
    ParsedDelta,
    ToolCallPiece,
    new_call_id,
)


class JsonArrayToolParser:
    """``[{"name": ..., "parameters": {...}}, ...]`` -> tool calls (no content).

    ``element_depth`` 1 reads top-level objects instead (``{...}; {...}``, llama3_json).
    ``forced``: the grammar writes every call whole, so one still open at the end was cut
    short and gets no made-up ``{}`` arguments (a cut call is dropped from a unary answer)."""

    def __init__(
        self, new_id: IdFactory = new_call_id, element_depth: int = 2, forced: bool = False
    ) -> None:
        self._new_id = new_id
        self._element_depth = element_depth
        self._forced = forced
        self._text = ""
        self._scanned = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._start: int | None = None  # where the open element began
        self._calls: list[CallBody] = []
        self._opened = False

    @property
    def complete(self) -> bool:
        """The whole output so far is closed JSON (``required``: the array ended)."""
        return self._opened and self._depth == 0 and not self._in_string

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._text += text
        for i in range(self._scanned, len(self._text)):
            self._scan(i, out)
        self._scanned = len(self._text)
        if self._start is not None:  # an element still streaming
            out.tool_calls.extend(self._calls[-1].update(self._text[self._start :]))
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._start is not None:
            call, text = self._calls[-1], self._text[self._start :]
            out.tool_calls.extend(call.update(text) if self._forced else call.finish(text))
            self._start = None
        return out

    def _scan(self, i: int, out: ParsedDelta) -> None:
        char = self._text[i]
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
            return
        if char == '"':
            self._in_string = True
        elif char in "[{":
            self._depth += 1
            self._opened = True
            if self._depth == self._element_depth and char == "{":
                self._start = i
                self._calls.append(CallBody(len(self._calls), self._new_id))
        elif char in "]}":
            self._depth -= 1
            if self._depth == self._element_depth - 1 and self._start is not None:
                element = self._text[self._start : i + 1]
                out.tool_calls.extend(self._calls[-1].finish(element))
                self._start = None


class NamedToolParser:
    """The whole output is the arguments of ``name`` (one call, no content)."""

    def __init__(self, name: str, new_id: IdFactory = new_call_id) -> None:
        self.name = name
        self._new_id = new_id
        self._started = False
        self._held = ""
        self._arguments = ""

    @property
    def complete(self) -> bool:
        """The arguments so far are one whole JSON value."""
        return _is_json(self._arguments)

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not self._started:
            self._started = True
            out.tool_calls.append(_first_piece(self.name, self._new_id()))
        text = self._held + text
        body = text.rstrip()  # trailing spaces wait: the end of the output drops them
        self._held = text[len(body) :]
        if body:
            self._arguments += body
            out.tool_calls.append(_args_piece(body))
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if not self._started:
            self._started = True
            out.tool_calls.append(_first_piece(self.name, self._new_id()))
        return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _first_piece(name: str, call_id: str) -> ToolCallPiece:
    return ToolCallPiece(0, call_id, name)


def _args_piece(text: str) -> ToolCallPiece:
    return ToolCallPiece(0, arguments=text)
