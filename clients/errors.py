"""Typed client exceptions, parsed from the server's rich ``google.rpc.Status``.

Every non-OK tokenwire status carries an ``ErrorInfo{reason, domain: "tokenwire", metadata}``
(``metadata["param"]`` names a bad parameter) and, for QUEUE_FULL, a ``RetryInfo``. The
exception class follows the reason when there is one, else the status code. ``reason`` is the
string as sent ("QUEUE_FULL"); ``error_reason`` is the same as a ``tokenwire.v1.ErrorReason``
(UNSPECIFIED when absent or unknown to this client version).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from tokenwire.v1 import errors_pb2
from tokenwire.v1.reasons import parse_reason

REQUEST_ID_KEY = "x-request-id"


class TokenwireError(Exception):
    """A failed tokenwire call: status ``code``, ErrorInfo ``reason`` and what they say."""

    default_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        reason: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
        request_id: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code: grpc.StatusCode = code if code is not None else self.default_code
        self.reason = reason
        self.param = param
        self.retry_after = retry_after
        self.request_id = request_id
        self.metadata: dict[str, str] = dict(metadata or {})

    @property
    def error_reason(self) -> errors_pb2.ErrorReason:
        """``reason`` as the enum; ERROR_REASON_UNSPECIFIED when absent or unknown here."""
        return parse_reason(self.reason)

    def __str__(self) -> str:
        label = self.reason or self.code.name
        return f"{label}: {self.message}" if self.message else label


class InvalidArgumentError(TokenwireError):
    """A request parameter is invalid (``param`` names it when the server said which)."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class ContextLengthExceededError(InvalidArgumentError):
    """Prompt (+ max_tokens) does not fit in the model's context window."""


class AuthenticationError(TokenwireError):
    """Missing or wrong API key."""

    default_code = grpc.StatusCode.UNAUTHENTICATED


class ModelNotFoundError(TokenwireError):
    """The requested model is not served."""

    default_code = grpc.StatusCode.NOT_FOUND


class DuplicateRequestError(TokenwireError):
    """A request with the same request id is already in flight."""

    default_code = grpc.StatusCode.ALREADY_EXISTS


class QueueFullError(TokenwireError):
    """The server's queue (or session table) is full; retry after ``retry_after`` seconds."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceededError(TokenwireError):
    """The call's deadline passed before it finished."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnavailableError(TokenwireError):
    """The server is draining, not ready, its engine is dead, or it cannot be reached."""

    default_code = grpc.StatusCode.UNAVAILABLE


class InternalError(TokenwireError):
    """The server failed while serving the request."""

    default_code = grpc.StatusCode.INTERNAL


class CancelledError(TokenwireError):
    """The call was cancelled."""

    default_code = grpc.StatusCode.CANCELLED


# Reasons not listed here (MALFORMED_REQUEST, TURN_IN_PROGRESS, unknown ones) follow the code.
_BY_REASON: dict[errors_pb2.ErrorReason, type[TokenwireError]] = {
    errors_pb2.ERROR_REASON_INVALID_PARAMETER: InvalidArgumentError,
    errors_pb2.ERROR_REASON_CONTEXT_LENGTH_EXCEEDED: ContextLengthExceededError,
    errors_pb2.ERROR_REASON_API_KEY_INVALID: AuthenticationError,
    errors_pb2.ERROR_REASON_MODEL_NOT_FOUND: ModelNotFoundError,
    errors_pb2.ERROR_REASON_DUPLICATE_REQUEST_ID: DuplicateRequestError,
    errors_pb2.ERROR_REASON_QUEUE_FULL: QueueFullError,
    errors_pb2.ERROR_REASON_TOO_MANY_SESSIONS: QueueFullError,
    errors_pb2.ERROR_REASON_SERVER_DRAINING: UnavailableError,
    errors_pb2.ERROR_REASON_NOT_READY: UnavailableError,
    errors_pb2.ERROR_REASON_ENGINE_DEAD: UnavailableError,
    errors_pb2.ERROR_REASON_ENGINE_ERROR: InternalError,
}

# RESOURCE_EXHAUSTED without a QUEUE_FULL reason is usually a message-size limit: no retry hint.
_BY_CODE: dict[grpc.StatusCode, type[TokenwireError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.NOT_FOUND: ModelNotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: DuplicateRequestError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.CANCELLED: CancelledError,
}

_CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True)
class _Details:
    """What the rich status details say."""

    reason: str | None = None
    param: str | None = None
    retry_after: float | None = None
    request_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)


def _parse_details(status: status_pb2.Status) -> _Details:
    info = error_details_pb2.ErrorInfo()
    retry = error_details_pb2.RetryInfo()
    request = error_details_pb2.RequestInfo()
    bad = error_details_pb2.BadRequest()
    has_info = has_retry = has_request = has_bad = False
    for detail in status.details:
        if detail.Is(info.DESCRIPTOR):
            has_info = detail.Unpack(info)
        elif detail.Is(retry.DESCRIPTOR):
            has_retry = detail.Unpack(retry)
        elif detail.Is(request.DESCRIPTOR):
            has_request = detail.Unpack(request)
        elif detail.Is(bad.DESCRIPTOR):
            has_bad = detail.Unpack(bad)
    metadata = dict(info.metadata) if has_info else {}
    param = metadata.get("param")
    if param is None and has_bad and bad.field_violations:
        param = bad.field_violations[0].field
    request_id = metadata.get("request_id") or (request.request_id if has_request else None)
    return _Details(
        reason=(info.reason or None) if has_info else None,
        param=param,
        retry_after=retry.retry_delay.ToTimedelta().total_seconds() if has_retry else None,
        request_id=request_id or None,
        metadata=metadata,
    )


def _build(
    code: grpc.StatusCode, message: str, details: _Details, request_id: str | None
) -> TokenwireError:
    cls = _BY_REASON.get(parse_reason(details.reason)) or _BY_CODE.get(code, TokenwireError)
    return cls(
        message,
        code=code,
        reason=details.reason,
        param=details.param,
        retry_after=details.retry_after,
        request_id=details.request_id or request_id,
        metadata=details.metadata,
    )


def from_status(status: status_pb2.Status, request_id: str | None = None) -> TokenwireError:
    """Convert an in-band ``google.rpc.Status`` (e.g. ``TurnEnd.error``)."""
    code = _CODE_BY_NUMBER.get(status.code, grpc.StatusCode.UNKNOWN)
    return _build(code, status.message, _parse_details(status), request_id)


def _rich_status(err: Any) -> status_pb2.Status | None:
    try:
        status: status_pb2.Status | None = rpc_status.from_call(err)
    except (ValueError, DecodeError, AttributeError, TypeError):
        return None
    return status


def _metadata_value(err: Any, key: str) -> str | None:
    try:
        pairs = err.trailing_metadata() or ()
        for name, value in pairs:
            if name == key and isinstance(value, str):
                return value
    except (AttributeError, TypeError, ValueError):
        return None
    return None


def from_rpc_error(err: grpc.RpcError, request_id: str | None = None) -> TokenwireError:
    """Convert a grpc (or grpc.aio) ``RpcError`` into the matching ``TokenwireError``.

    Falls back to the plain status code and details when the rich status is missing or
    inconsistent. ``request_id`` is used when the server did not name one.
    """
    code_fn = getattr(err, "code", None)
    code = code_fn() if callable(code_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details_fn = getattr(err, "details", None)
    message = details_fn() if callable(details_fn) else None
    status = _rich_status(err)
    parsed = _parse_details(status) if status is not None else _Details()
    echoed = _metadata_value(err, REQUEST_ID_KEY)
    return _build(code, str(message or ""), parsed, echoed or request_id)
