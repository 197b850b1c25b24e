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
