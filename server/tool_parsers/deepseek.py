"""``deepseek_v3`` tool-call parser: DeepSeek-V3 / R1-0528 and V3.1 calls.

V3 (and R1-0528) write::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 drops the type and the fence: ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":
"Paris"}<｜tool▁call▁end｜>``. Both are read: after ``<｜tool▁call▁begin｜>`` the text up to
``<｜tool▁sep｜>`` is ``function`` (V3: the name follows, up to a newline, then the JSON in a
```` ```json ```` fence) or the name itself (V3.1: the JSON follows). Text before the calls
block is content (a marker split across deltas is held back). The name streams once known;
the arguments stream as the raw JSON the model wrote, less surrounding blanks, holding back
any suffix that may begin the closing fence or marker.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenwire.server.tool_parsers.tool_choice import FunctionSpec
from tokenwire.server.tool_parsers.types import (
    IdFactory,
    ParsedDelta,
    ToolCallPiece,
    held_prefix,
    new_call_id,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"


def _cut(text: str, ends: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the first of ``ends`` (True when one was found), else less any suffix
    that may begin one of them."""
    found = [i for i in (text.find(e) for e in ends) if i >= 0]
    if found:
        return text[: min(found)], True
    keep = max(held_prefix(text, e) for e in ends)
    return text[: len(text) - keep], False


class DeepSeekV3ToolParser:
    def __init__(
        self,
        new_id: IdFactory = new_call_id,
        parallel: bool = True,
        tools: Sequence[FunctionSpec] = (),
    ) -> None:
        self._new_id = new_id
        self.parallel = parallel
        self._pending = ""
        self._state = "content"  # content -> calls -> call -> calls ... -> content
        self._body = ""  # the open call's text after <｜tool▁call▁begin｜>
        self._name: str | None = None
        self._args_at = -1  # where the open call's JSON starts in its body
        self._sent = ""  # arguments streamed for the open call
        self._num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._pending += text
        while self._pending and self._step(out, final=False):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        while self._pending and self._step(out, final=True):
            pass
        if self._state == "call":
            self._end_call(out)
        elif self._state == "content":
            out.content += self._pending
        self._pending = ""
        return out

    def _step(self, out: ParsedDelta, final: bool) -> bool:
        """One state change; False when more text is needed."""
        if self._state == "content":
            return self._content(out)
        if self._state == "calls":
            return self._between(out)
        return self._call(out, final)

    def _content(self, out: ParsedDelta) -> bool:
        text = self._pending
        starts = [i for i in (text.find(CALLS_BEGIN), text.find(CALL_BEGIN)) if i >= 0]
        if not starts:
            keep = max(held_prefix(text, CALLS_BEGIN), held_prefix(text, CALL_BEGIN))
            out.content += text[: len(text) - keep]
            self._pending = text[len(text) - keep :]
            return False
        start = min(starts)
        out.content += text[:start]
        self._pending = text[start:].removeprefix(CALLS_BEGIN)
        self._state = "calls"
        return True

    def _between(self, out: ParsedDelta) -> bool:
        """Between calls: the next call, the end of the block, or blanks."""
        text = self._pending.lstrip()
        if text.startswith(CALL_BEGIN):
            self._pending, self._state = text[len(CALL_BEGIN) :], "call"
            self._body, self._name, self._args_at, self._sent = "", None, -1, ""
            return True
        if text.startswith(CALLS_END):
            self._pending, self._state = text[len(CALLS_END) :], "content"
            return True
        if CALL_BEGIN.startswith(text) or CALLS_END.startswith(text):
            self._pending = text
            return False
        self._state = "content"  # anything else: back to text
        self._pending = text
        return True

    def _call(self, out: ParsedDelta, final: bool) -> bool:
        self._body += self._pending
        self._pending = ""
        end = self._body.find(CALL_END)
        if end >= 0:
            self._pending = self._body[end + len(CALL_END) :]
            self._body = self._body[:end]
        if self._name is None:
            self._read_header(out, complete=end >= 0 or final)
        if self._name is not None:
            self._stream_args(out, complete=end >= 0)
        if end < 0:
            return False
        self._end_call(out)
        return True

    def _read_header(self, out: ParsedDelta, complete: bool) -> None:
        sep = self._body.find(SEP)
        if sep < 0:
            return
        kind, rest = self._body[:sep].strip(), self._body[sep + len(SEP) :]
        if kind == "function":  # V3: the name ends at a newline
            line = rest.find("\n")
            if line < 0 and not complete:
                return
            name = (rest if line < 0 else rest[:line]).strip()
            args_at = sep + len(SEP) + (len(rest) if line < 0 else line + 1)
        else:  # V3.1: the header is the name
            name, args_at = kind, sep + len(SEP)
        if not name:
            return
        self._name, self._args_at = name, args_at
        if self._reporting:
            out.tool_calls.append(ToolCallPiece(self._num_calls, self._new_id(), name))

    @property
    def _reporting(self) -> bool:
        return self.parallel or self._num_calls == 0

    def _stream_args(self, out: ParsedDelta, complete: bool) -> None:
        raw = self._body[self._args_at :].lstrip()
        if raw.startswith(FENCE_OPEN):
            raw = raw[len(FENCE_OPEN) :].lstrip()
        elif not complete and FENCE_OPEN.startswith(raw):
            return  # may be the fence
        if complete:
            args = raw.split(FENCE_CLOSE)[0].strip() if FENCE_CLOSE in raw else raw.strip()
        else:
            args = _cut(raw, (FENCE_CLOSE, CALL_END))[0].rstrip()
        if len(args) > len(self._sent) and args.startswith(self._sent):
            if self._reporting:
                piece = ToolCallPiece(self._num_calls, arguments=args[len(self._sent) :])
                out.tool_calls.append(piece)
            self._sent = args

    def _end_call(self, out: ParsedDelta) -> None:
        if self._name is None:
            self._read_header(out, complete=True)
        if self._name is None:  # no name: the model's text, as written
            out.content += CALL_BEGIN + self._body
        else:
            self._stream_args(out, complete=True)
            if not self._sent and self._reporting:
                out.tool_calls.append(ToolCallPiece(self._num_calls, arguments="{}"))
            self._num_calls += 1
        self._state, self._body, self._name = "calls", "", None
