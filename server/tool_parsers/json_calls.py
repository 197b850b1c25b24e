"""``llama3_json``, ``mistral`` and ``granite`` tool-call parsers: bare JSON after a marker.

Llama 3.x writes ``<|python_tag|>{"name": ..., "parameters": {...}}`` (calls separated by
``;``), Mistral ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, Granite 3.x
``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``. The markers are
special tokens, usually skipped from the text, so an output is read as calls when it opens
with the marker or directly with ``{`` (llama3_json) / ``[`` (mistral); anything else is
content (decided on the first characters, held back until then).
"""

from __future__ import annotations

from tokenwire.server.tool_parsers.forced import JsonArrayToolParser
from tokenwire.server.tool_parsers.types import IdFactory, ParsedDelta, new_call_id


class MarkedJsonToolParser:
    def __init__(self, marker: str, opener: str, new_id: IdFactory = new_call_id) -> None:
        self.marker = marker
        self.opener = opener
        self._calls = JsonArrayToolParser(new_id, element_depth=1 if opener == "{" else 2)
        self._mode: str | None = None  # None: undecided; "calls" or "content"
        self._pending = ""

    def feed(self, text: str) -> ParsedDelta:
        if self._mode is None:
            self._pending += text
            head = self._pending.lstrip()
            if head.startswith(self.marker):
                head = head[len(self.marker) :].lstrip()
                if not head:
                    return ParsedDelta()
            elif self.marker.startswith(head):
                return ParsedDelta()  # may still become the marker
            self._mode = "calls" if head.startswith(self.opener) else "content"
            text = head if self._mode == "calls" else self._pending
            self._pending = ""
        if self._mode == "calls":
            return self._calls.feed(text)
        return ParsedDelta(content=text)

    def finish(self) -> ParsedDelta:
        if self._mode == "calls":
            return self._calls.finish()
        out = ParsedDelta(content=self._pending)
        self._pending = ""
        return out


def llama3_json_parser(new_id: IdFactory = new_call_id) -> MarkedJsonToolParser:
    return MarkedJsonToolParser("<|python_tag|>", "{", new_id)


def mistral_parser(new_id: IdFactory = new_call_id) -> MarkedJsonToolParser:
    return MarkedJsonToolParser("[TOOL_CALLS]", "[", new_id)


def granite_parser(new_id: IdFactory = new_call_id) -> MarkedJsonToolParser:
    return MarkedJsonToolParser("<|tool_call|>", "[", new_id)
