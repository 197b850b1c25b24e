"""Errors the runtime raises towards its callers (the servers map them to status codes)."""

from __future__ import annotations


class ParameterError(ValueError):
    """A request parameter is invalid. ``param`` names it (OpenAI-style field name)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class ContextLengthError(ParameterError):
    """Prompt (+ max_tokens) does not fit in the model's context window."""


class WrongTaskError(ValueError):
    """The model does not serve this kind of request (generation on an embedding model, or
    embeddings on a generation model); ``task`` is what the model serves."""

    def __init__(self, model: str, task: str, message: str) -> None:
        super().__init__(message)
        self.model = model
        self.task = task


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


class AdapterError(ParameterError):
    """A LoRA adapter cannot be loaded (bad files, rank, shapes or target modules; LoRA not
    enabled; a path outside the allowed root). The server keeps serving."""


class AdapterExistsError(ValueError):
    """An adapter of this name is already loaded."""

    def __init__(self, name: str) -> None:
        super().__init__(f"a LoRA adapter named {clip(name)!r} is already loaded")
        self.name = name


class AdapterNotFoundError(LookupError):
    """No loaded adapter has this name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no LoRA adapter named {clip(name)!r} is loaded")
        self.name = name
