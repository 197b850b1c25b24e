"""``hermes`` tool-call parser: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format of Hermes, Qwen2.5/Qwen3 and SmolLM2 chat models. Text outside the tags is
content; text that may be the start of a tag is held back until it is known not to be. A
call whose JSON never completes (or is not a call) is given back as content, unless its name
was already streamed. The closing tag may be missing at the end of the output.
"""

from __future__ import annotations

from tokenwire.server.tool_parsers.call_body import CallBody, complete_object
from tokenwire.server.tool_parsers.types import IdFactory, ParsedDelta, held_prefix, new_call_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser:
    def __init__(self, new_id: IdFactory = new_call_id, parallel: bool = True) -> None:
        self._new_id = new_id
        self.parallel = parallel  # False: only the first call is reported
        self._pending = ""  # unprocessed text (content that may start a tag)
        self._body: str | None = None  # inside a call: its text so far
        self._call: CallBody | None = None
        self._num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._pending += text
        while self._pending:
            if self._body is None:
                if not self._content(out):
                    break
            elif not self._inside(out):
                break
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._body is None:
            out.content += self._pending
        else:
            self._end_call(self._body + self._pending, out)
        self._pending = ""
        return out

    # ------------------------------------------------------------------ states
    def _content(self, out: ParsedDelta) -> bool:
        """Emit content up to a tag; True when a call opened (more to process)."""
        start = self._pending.find(OPEN)
        if start < 0:
            keep = held_prefix(self._pending, OPEN)
            out.content += self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep :]
            return False
        out.content += self._pending[:start]
        self._pending = self._pending[start + len(OPEN) :]
        self._body = ""
        self._call = CallBody(self._num_calls, self._new_id)
        return True

    def _inside(self, out: ParsedDelta) -> bool:
        """Grow the open call; True when it closed (more to process)."""
        assert self._body is not None and self._call is not None
        body = self._body + self._pending
        end = body.find(CLOSE)
        if end < 0:
            keep = held_prefix(body, CLOSE)
            self._body, self._pending = body[: len(body) - keep], body[len(body) - keep :]
            if self._reporting:
                out.tool_calls.extend(self._call.update(self._body.strip()))
            return False
        self._pending = body[end + len(CLOSE) :]
        self._end_call(body[:end], out, CLOSE)
        return True

    @property
    def _reporting(self) -> bool:
        return self.parallel or self._num_calls == 0

    def _end_call(self, body: str, out: ParsedDelta, close: str = "") -> None:
        assert self._call is not None
        text = body.strip()
        if complete_object(text) is not None or self._call.started:
            if self._reporting:
                out.tool_calls.extend(self._call.finish(text))
            self._num_calls += 1
        else:  # not a call after all: the model's text, as written
            out.content += OPEN + body + close
        self._body, self._call = None, None
