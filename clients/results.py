"""Plain result and event types the tokenwire clients return (no protobuf in user code).

Finish reasons are the ``FinishReason`` enum names without their prefix, lowercased:
``"length"``, ``"context_length"``, ``"eos"``, ``"stop_token"``, ``"stop_sequence"``,
``"time_limit"``, ``"cancelled"``, ``"error"`` (``"unspecified"`` if the server sent none).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """One token with its log probability and 1-based rank in the distribution."""

    token_id: int
    token: str
    logprob: float
    rank: int


@dataclass(frozen=True)
class PositionLogprobs:
    """Logprobs at one generated position: the chosen token and the top alternatives."""

    token_id: int
    token: str
    logprob: float
    rank: int
    top: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Usage:
    """Token accounting of one request (all choices)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Choice:
    """One finished choice of a completion."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: str
    stop_sequence: str | None = None
    stop_token_id: int | None = None


@dataclass(frozen=True)
class Completion:
    """The complete answer to one generate request."""

    request_id: str
    model: str
    choices: list[Choice]
    usage: Usage

    @property
    def text(self) -> str:
        """Text of the first choice (the only one unless ``n > 1``)."""
        return self.choices[0].text if self.choices else ""


# ------------------------------------------------------------------------------- streams


@dataclass(frozen=True)
class StreamStart:
    """First stream event: the request was admitted."""

    request_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class TextDelta:
    """New output of one choice (a delta, never cumulative)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs]


@dataclass(frozen=True)
class ChoiceEnd:
    """One per choice, after that choice's last delta."""

    index: int
    finish_reason: str
    stop_sequence: str | None
    stop_token_id: int | None
    completion_tokens: int


@dataclass(frozen=True)
class StreamUsage:
    """The last event of a stream."""

    usage: Usage


StreamEvent = StreamStart | TextDelta | ChoiceEnd | StreamUsage

# ------------------------------------------------------------------------------ sessions


@dataclass(frozen=True)
class SessionInfo:
    """What the server answered to Open."""

    session_id: str
    model: str
    max_context_tokens: int


@dataclass(frozen=True)
class TurnStart:
    """A turn was admitted; ``cached_tokens`` of ``prompt_tokens`` came from the session."""

    turn: int
    request_id: str
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class TurnEnd:
    """One per choice of a turn, after that choice's last delta."""

    turn: int
    index: int
    finish_reason: str
    stop_sequence: str | None
    stop_token_id: int | None
    usage: Usage


@dataclass(frozen=True)
class Notice:
    """A server notice: ``kind`` is ``"draining"``, ``"context_evicted"`` or ``"idle_timeout"``."""

    kind: str
    message: str


SessionEvent = TurnStart | TextDelta | TurnEnd | Notice
