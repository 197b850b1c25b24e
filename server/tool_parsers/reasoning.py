"""Reasoning parsers: ``<think>…</think>`` -> reasoning text, the rest -> content.

``qwen3``: reasoning only when the output opens with ``<think>`` (Qwen3 writes it unless
thinking is off); ``deepseek_r1``: the output starts in reasoning (the template opened the
tag; a leading ``<think>`` is dropped). Either way reasoning ends at ``</think>``, the
newlines after it are dropped, and a tag split across deltas is held back until known. The
same incremental code serves streams and unary answers, so they always agree (an output that
never closes its ``<think>`` is all reasoning).
"""

from __future__ import annotations

from tokenwire.server.tool_parsers.types import ParsedDelta, held_prefix

THINK, END_THINK = "<think>", "</think>"


class ThinkReasoningParser:
    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self._state = "start"  # start -> reasoning | content; reasoning -> after -> content
        self._pending = ""

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._pending += text
        progressed = True
        while progressed and self._pending:
            progressed = self._step(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        while self._pending and self._step(out, final=True):
            pass
        if self._pending:  # whatever is held: in its current role
            if self._state == "reasoning":
                out.reasoning += self._pending
            else:
                out.content += self._pending
            self._pending = ""
        return out

    def _step(self, out: ParsedDelta, final: bool) -> bool:
        """Advance one state change; False when more text is needed (or none is left)."""
        text = self._pending
        if self._state == "start":
            stripped = text.lstrip()
            if stripped.startswith(THINK):
                self._state, self._pending = "reasoning", stripped[len(THINK) :]
            elif not final and THINK.startswith(stripped):
                return False  # may still become the tag
            else:
                self._state = "reasoning" if self.starts_in_reasoning else "content"
            return True
        if self._state == "reasoning":
            end = text.find(END_THINK)
            if end >= 0:
                out.reasoning += text[:end]
                self._state, self._pending = "after", text[end + len(END_THINK) :]
                return True
            keep = 0 if final else held_prefix(text, END_THINK)
            out.reasoning += text[: len(text) - keep]
            self._pending = text[len(text) - keep :]
            return False
        if self._state == "after":
            rest = text.lstrip("\n")
            if not rest and not final:
                self._pending = ""
                return False
            self._state, self._pending = "content", rest
            return True
        out.content += text
        self._pending = ""
        return False


def make_reasoning_parser(name: str) -> ThinkReasoningParser:
    if name == "qwen3":
        return ThinkReasoningParser(starts_in_reasoning=False)
    if name == "deepseek_r1":
        return ThinkReasoningParser(starts_in_reasoning=True)
    raise ValueError(f"unknown reasoning parser {name!r}: choose qwen3 or deepseek_r1")
