"""Errors the runtime raises towards its callers (the servers map them to status codes)."""

from __future__ import annotations


class ParameterError(ValueError):
    """A request parameter is invalid. ``param`` names it (OpenAI-style field name)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class ContextLengthError(ParameterError):
    """Prompt (+ max_tokens) does not fit in the model's context window."""


class DuplicateRequestError(ValueError):
    """A request with this request_id is already in flight."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request_id {request_id!r} is already in flight")
        self.request_id = request_id


class EngineDeadError(RuntimeError):
    """The engine loop failed and can no longer serve requests."""


class QueueFullError(RuntimeError):
    """Too many sequences (or tokenization jobs) in flight; retry after ``retry_after`` s."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DrainingError(RuntimeError):
    """The server is shutting down and accepts no new requests."""


class NotReadyError(RuntimeError):
    """The engine is still loading or warming up."""


MAX_ECHO_CHARS = 256


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``repr``-free text of client input for an error message, at most ``limit`` characters
    plus an ellipsis: an error must never grow with what the client sent."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "…"
