"""Plain records of parsed model output: tool calls, their streamed pieces, and one delta.

A parser turns text deltas into ``ParsedDelta``s: the content the user sees, reasoning text
(with a reasoning parser) and pieces of tool calls. The first piece of call ``index`` carries
its ``id`` and ``name``; its ``arguments`` pieces concatenate to the call's arguments (JSON
text), which is how OpenAI streams ``tool_calls``.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

IdFactory = Callable[[], str]


def new_call_id() -> str:
    """An OpenAI-style tool call id (``call_`` + 24 hex digits)."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True, slots=True)
class ToolCallPiece:
    index: int
    id: str = ""  # set on the call's first piece only
    name: str = ""  # set on the call's first piece only
    arguments: str = ""


@dataclass(slots=True)
class ToolCallInfo:
    """A whole tool call (what the unary answer reports)."""

    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallPiece] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)


def merge_pieces(pieces: list[ToolCallPiece]) -> list[ToolCallInfo]:
    """Whole calls from their streamed pieces, in call order."""
    calls: dict[int, ToolCallInfo] = {}
    for piece in pieces:
        call = calls.get(piece.index)
        if call is None:
            call = calls[piece.index] = ToolCallInfo(piece.id, piece.name)
        call.arguments += piece.arguments
    return [calls[i] for i in sorted(calls)]


def coalesce_pieces(pieces: list[ToolCallPiece]) -> list[ToolCallPiece]:
    """At most one piece per call index, in first-seen order (OpenAI sends one delta per
    call per chunk): a call's later pieces' arguments join its first piece of the list,
    which keeps that piece's id and name."""
    merged: dict[int, ToolCallPiece] = {}
    for piece in pieces:
        known = merged.get(piece.index)
        if known is None:
            merged[piece.index] = piece
        else:
            merged[piece.index] = ToolCallPiece(
                piece.index, known.id, known.name, known.arguments + piece.arguments
            )
    return list(merged.values())


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (text
    that may yet become the tag, so a streaming parser must hold it back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
