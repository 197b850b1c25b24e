"""``pythonic`` tool-call parser: calls as a Python list, as Llama 3.2 and Llama 4 write them.

    [get_weather(city="Paris", days=3), get_time()]

(Llama 4 may wrap it in ``<|python_start|>`` ... ``<|python_end|>``; the markers are
dropped.) An output is read as calls when it opens with ``[`` (after blanks and the marker);
anything else is content, decided on the first characters (held back until then). Each
element is parsed with ``ast`` once it is complete (a top-level ``,`` or the closing ``]``,
found by a scanner that knows strings and brackets): its name streams first, then its
keyword arguments as one JSON object (``json.dumps``). Values are Python literals (JSON's
``true`` / ``false`` / ``null`` are read too). If the first element is not a call, the held
text is given back as content (``[1] is a citation``). Text after the closing ``]`` is
content. A list cut short (``max_tokens``) keeps its last call if closing its open strings
and brackets makes it one.
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
    new_call_id,
)

START, END = "<|python_start|>", "<|python_end|>"
_CLOSERS = {"(": ")", "[": "]", "{": "}"}
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class _NotACall(ValueError):
    pass


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.Dict):
        return {
            _literal(k) if k is not None else _not_a_call(): _literal(v)
            for k, v in zip(node.keys, node.values, strict=True)
        }
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(v) for v in node.elts]
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise _NotACall from None


def _not_a_call() -> Any:
    raise _NotACall


def parse_call(text: str) -> tuple[str, dict[str, Any]]:
    """``name(a=1, b="x")`` -> (name, arguments); raises ``_NotACall``."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise _NotACall from None
    call = tree.body
    if not isinstance(call, ast.Call) or call.args:
        raise _NotACall
    func = call.func
    if isinstance(func, ast.Name):
        name = func.id
    elif isinstance(func, ast.Attribute):
        name = ast.unparse(func)
    else:
        raise _NotACall
    arguments: dict[str, Any] = {}
    for keyword in call.keywords:
        if keyword.arg is None:
            raise _NotACall
        arguments[keyword.arg] = _literal(keyword.value)
    try:
        json.dumps(arguments)
    except (TypeError, ValueError):
        raise _NotACall from None
    return name, arguments


class PythonicToolParser:
    def __init__(
        self,
        new_id: IdFactory = new_call_id,
        parallel: bool = True,
        tools: Sequence[FunctionSpec] = (),
    ) -> None:
        self._new_id = new_id
        self.parallel = parallel
        self._mode: str | None = None  # None: undecided; "calls", "content" or "after"
        self._text = ""  # undecided / calls: held text; after: text that may be the end marker
        self._scanned = 0
        self._stack: list[str] = []  # open brackets
        self._quote = ""  # the open string's quote character
        self._escaped = False
        self._element_start = 1  # just after ``[``
        self._num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode is None:
            self._text += text
            head = self._text.lstrip()
            if head.startswith(START):
                head = head[len(START) :].lstrip()
            elif START.startswith(head):
                return out  # may still become the marker (or nothing but blanks so far)
            if not head:
                return out
            self._mode = "calls" if head.startswith("[") else "content"
            text = head if self._mode == "calls" else self._text
            self._text = ""
        if self._mode == "calls":
            self._text += text
            self._scan(out)
        elif self._mode == "after":
            self._tail(text, out)
        else:
            out.content += text
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode == "calls":  # cut short: the open call, closed (else all is text)
            closers = self._quote + "".join(_CLOSERS[c] for c in reversed(self._stack[1:]))
            self._element(self._text[self._element_start :] + closers, out)
            if self._mode == "calls" and self._num_calls == 0:
                out.content += self._text
        elif self._mode != "content":
            out.content += self._text
        self._text = ""
        return out

    def _scan(self, out: ParsedDelta) -> None:
        i = self._scanned
        while i < len(self._text) and self._mode == "calls":
            end = self._scan_char(i, out)
            if end is not None and self._mode == "calls":  # closed: what follows is content
                rest, self._text = self._text[end:], ""
                self._mode = "after"
                self._tail(rest, out)
                return
            i += 1
        self._scanned = i

    def _tail(self, text: str, out: ParsedDelta) -> None:
        """After the list: content, less a leading end marker."""
        self._text += text
        if END.startswith(self._text) and self._text != END:
            return  # may still become the marker
        out.content += self._text.removeprefix(END)
        self._text = ""
        self._mode = "content"

    def _scan_char(self, i: int, out: ParsedDelta) -> int | None:
        """Advance over ``self._text[i]``; the end of the list (``i + 1``) when it closed."""
        char = self._text[i]
        if self._quote:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == self._quote:
                self._quote = ""
        elif char in "\"'":
            self._quote = char
        elif char in "([{":
            self._stack.append(char)
        elif char in ")]}":
            if self._stack:
                self._stack.pop()
            if not self._stack:
                self._element(self._text[self._element_start : i], out)
                return i + 1
        elif char == "," and len(self._stack) == 1:
            self._element(self._text[self._element_start : i], out)
            self._element_start = i + 1
        return None

    def _element(self, text: str, out: ParsedDelta) -> None:
        if self._mode != "calls" or (self._num_calls and not text.strip()):
            return
        try:
            name, arguments = parse_call(text)
        except _NotACall:
            if self._num_calls == 0:  # not calls at all: everything is content
                self._mode = "content"
                out.content += self._text
                self._text = ""
            return
        if self.parallel or self._num_calls == 0:
            index = self._num_calls
            out.tool_calls.append(ToolCallPiece(index, self._new_id(), name))
            out.tool_calls.append(ToolCallPiece(index, arguments=json.dumps(arguments)))
        self._num_calls += 1
