"""``CallBody``: one tool call's JSON object, parsed while it streams in.

The object is ``{"name": ..., "arguments": {...}}`` (``parameters`` is accepted too). The name
is read with partial-json-parser as soon as its string is closed; the arguments are the raw
text of the arguments value, streamed as it arrives (everything after ``"arguments":`` belongs
to it until the value is complete, since an unclosed object cannot be followed by anything),
so the pieces concatenate to exactly the text the model wrote.
"""

from __future__ import annotations

import json
import re
from typing import Any

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

from tokenwire.server.tool_parsers.types import IdFactory, ToolCallPiece

_ARGS_KEY = re.compile(r'"(arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


def _partial_object(text: str) -> dict[str, Any] | None:
    try:
        value = partial_loads(text, Allow.ALL & ~Allow.STR)
    except Exception:  # not JSON (yet): nothing to read
        return None
    return value if isinstance(value, dict) else None


class CallBody:
    """Feed the object's text so far with ``update``; pieces come back as they are known."""

    def __init__(self, index: int, new_id: IdFactory, name: str | None = None) -> None:
        self.index = index
        self._new_id = new_id
        self.name: str | None = None
        self._args_sent = ""
        self._args_done = False
        self._known_name = name

    @property
    def started(self) -> bool:
        return self.name is not None

    def update(self, text: str) -> list[ToolCallPiece]:
        """``text``: the whole object so far (it only ever grows)."""
        pieces: list[ToolCallPiece] = []
        if self.name is None:
            name = self._known_name
            if name is None:
                parsed = _partial_object(text)
                value = None if parsed is None else parsed.get("name")
                name = value if isinstance(value, str) and value else None
            if name is None:
                return pieces
            self.name = name
            pieces.append(ToolCallPiece(self.index, self._new_id(), name))
        if not self._args_done:
            args = self._arguments_text(text)
            if args is not None and len(args) > len(self._args_sent):
                pieces.append(ToolCallPiece(self.index, arguments=args[len(self._args_sent) :]))
                self._args_sent = args
        return pieces

    def _arguments_text(self, text: str) -> str | None:
        match = _ARGS_KEY.search(text)
        if match is None:
            return None
        raw = text[match.end() :]
        try:
            _, end = _DECODER.raw_decode(raw)
        except ValueError:
            return raw.rstrip()  # incomplete: all of it is arguments (trailing spaces may go)
        self._args_done = True
        return raw[:end]

    def finish(self, text: str) -> list[ToolCallPiece]:
        """The object is complete: last pieces, with ``{}`` for a call without arguments."""
        pieces = self.update(text)
        if self.name is not None and not self._args_sent:
            pieces.append(ToolCallPiece(self.index, arguments="{}"))
            self._args_sent = "{}"
        return pieces


def complete_object(text: str) -> dict[str, Any] | None:
    """``text`` as one JSON object with a string ``name``, else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return value
    return None
