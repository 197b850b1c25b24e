"""REST errors: gRPC status / validation failures -> HTTP status + OpenAI error envelope.

Envelope: ``{"error": {"message", "type", "param", "code"}}``. HTTP status follows the
docs/api.md Errors table from the gRPC code (and ``ErrorInfo.reason``); ``type`` follows
the HTTP status (OpenAI's ``invalid_request_error``, ``authentication_error``, ...); ``code``
is the OpenAI code where one exists (``invalid_api_key``, ``model_not_found``,
``context_length_exceeded``, ``rate_limit_exceeded``), else the reason in lower case.
``param`` is the OpenAI field name (the proto name translated per request). Messages are
passed through only from tokenwire's own statuses (ErrorInfo domain "tokenwire", which never
carry a path, traceback or key), and only when the rich status agrees with the call's own code
(grpc-core replaces the code when it drops a call, e.g. RESOURCE_EXHAUSTED for oversized
trailers); anything else gets a fixed message. Only RESOURCE_EXHAUSTED with a rate-limit reason
(QUEUE_FULL, TOO_MANY_SESSIONS, a tenant's RATE_LIMITED) is a 429 (with ``Retry-After``), which
SDKs retry; any other RESOURCE_EXHAUSTED is a 413. Client input quoted in a message is clipped
(``clip``): an error never grows with what the client sent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from tokenwire.v1 import errors_pb2
from tokenwire.v1.reasons import parse_reason

STATUS_DETAILS_KEY = "grpc-status-details-bin"
MAX_ECHO_CHARS = 256  # client input quoted in an error message (the gRPC side clips the same)
MAX_MESSAGE_CHARS = 1024  # a gRPC status message passed through

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    499: "cancelled_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
_OPENAI_CODES: dict[errors_pb2.ErrorReason, str] = {
    errors_pb2.ERROR_REASON_API_KEY_INVALID: "invalid_api_key",
    errors_pb2.ERROR_REASON_MODEL_NOT_FOUND: "model_not_found",
    errors_pb2.ERROR_REASON_CONTEXT_LENGTH_EXCEEDED: "context_length_exceeded",
    errors_pb2.ERROR_REASON_QUEUE_FULL: "rate_limit_exceeded",
    errors_pb2.ERROR_REASON_TOO_MANY_SESSIONS: "rate_limit_exceeded",
    errors_pb2.ERROR_REASON_RATE_LIMITED: "rate_limit_exceeded",  # a tenant's limit
}
_RATE_LIMIT_REASONS = frozenset(
    {
        errors_pb2.ERROR_REASON_QUEUE_FULL,
        errors_pb2.ERROR_REASON_TOO_MANY_SESSIONS,
        errors_pb2.ERROR_REASON_RATE_LIMITED,
    }
)
_FALLBACK_MESSAGES = {
    grpc.StatusCode.UNAVAILABLE: "the inference server is unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the request timed out",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the request exceeds a server limit",
    grpc.StatusCode.UNAUTHENTICATED: "missing or invalid API key",
}


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """Client input for an error message: at most ``limit`` characters plus an ellipsis, and
    always encodable as UTF-8 (a lone surrogate becomes its ``\\udxxx`` escape), so quoting it
    can neither grow the error without bound nor make the error response itself fail."""
    text = str(value)[: limit + 1].encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "\u2026"


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


@dataclass
class RestError(Exception):
    """An error with a definite HTTP status; raise it anywhere in a handler."""

    status: int
    message: str
    code: str
    param: str | None = None
    retry_after: float | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": error_type(self.status),
                "param": self.param,
                "code": self.code,
            }
        }

    def response_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after)))
        return headers

    def sse_event(self) -> bytes:
        """The in-stream form: an SSE ``data:`` event the OpenAI SDK raises as APIError."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def invalid(param: str | None, message: str, code: str = "invalid_value") -> RestError:
    return RestError(400, message, code, param)


@dataclass(frozen=True)
class _Rich:
    reason: str | None = None  # ErrorInfo.reason as sent (a newer server's may be unknown here)
    metadata: Mapping[str, str] = field(default_factory=dict)
    retry_after: float | None = None
    message: str | None = None  # only from tokenwire's own statuses


def _rich_status(err: grpc.aio.AioRpcError) -> _Rich:
    blob = None
    for key, value in err.trailing_metadata() or ():
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            blob = value
    if blob is None:
        return _Rich()
    try:
        status = status_pb2.Status.FromString(blob)
    except DecodeError:
        return _Rich()
    if status.code != err.code().value[0]:
        return _Rich()  # not the status the server sent: grpc-core failed the call itself
    info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
    rich = _Rich()
    for detail in status.details:
        if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == "tokenwire":
            rich = _Rich(info.reason, dict(info.metadata), rich.retry_after, status.message)
        elif detail.Is(retry.DESCRIPTOR) and detail.Unpack(retry):
            delay = retry.retry_delay.ToTimedelta().total_seconds()
            rich = _Rich(rich.reason, rich.metadata, delay, rich.message)
    return rich


def from_rpc_error(err: grpc.aio.AioRpcError, params: Mapping[str, str]) -> RestError:
    """Translate a failed gRPC call; ``params`` maps proto field names to OpenAI ones."""
    code = err.code()
    rich = _rich_status(err)
    reason = parse_reason(rich.reason)
    status = _HTTP_STATUS.get(code, 500)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and reason not in _RATE_LIMIT_REASONS:
        status = 413  # a size limit (message, metadata), not a full queue: retrying won't help
    proto_param = rich.metadata.get("param")
    param = params.get(proto_param, proto_param) if proto_param else None
    if rich.message:
        message = clip(rich.message, MAX_MESSAGE_CHARS)
    else:
        message = _FALLBACK_MESSAGES.get(code, "internal error")
    if proto_param and param != proto_param:
        message = message.replace(f"{proto_param}:", f"{param}:", 1)
    openai_code = _OPENAI_CODES.get(reason) or (rich.reason or code.name).lower()
    return RestError(
        status,
        message,
        openai_code,
        param,
        rich.retry_after,
    )


NOT_UNICODE = "not valid Unicode text (a lone surrogate such as \\ud800)"


def _loc_text(loc: Sequence[Any]) -> str:
    return ".".join(clip(part) for part in loc)  # a part may be a client's key


def from_validation_errors(errors: Sequence[Any]) -> RestError:
    """A FastAPI/pydantic body validation failure -> 400 naming the field.

    ``param`` is the top-level field (the full dotted path for an unknown or unsupported
    nested field); the message names the full location. Paths and messages are clipped: they
    may quote the client's keys and values.
    """
    if not errors:
        return invalid(None, "invalid request body")
    first = errors[0]
    kind = str(first.get("type", ""))
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if kind == "invalid_unicode":  # the offending string's path inside the field
        loc = [*loc, *first.get("ctx", {}).get("path", ())]
    elif kind == "string_unicode":  # pydantic's own check (object keys, literals)
        where = _loc_text(loc) if loc else "the request body"
        return invalid(clip(loc[0]) if loc else None, f"{where}: {NOT_UNICODE}")
    if kind == "json_invalid":
        return invalid(None, "the request body is not valid JSON", "invalid_json")
    if not loc:
        return invalid(None, "the request body must be a JSON object", "invalid_type")
    path = _loc_text(loc)
    if kind in ("model_attributes_type", "dict_type", "model_type"):  # a field's object
        return invalid(clip(loc[0]), f"{path}: must be a JSON object", "invalid_type")
    if kind == "extra_forbidden":
        return invalid(path, f"unknown field {path!r}", "unknown_parameter")
    if kind == "unsupported_parameter":
        return invalid(path, f"{path}: {first.get('msg')}", "unsupported_parameter")
    if kind == "missing":
        return invalid(path, f"{path}: field required", "missing_required")
    msg = clip(first.get("msg", "invalid value"), MAX_MESSAGE_CHARS)
    return invalid(clip(loc[0]), f"{path}: {msg}")
