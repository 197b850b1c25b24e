"""Per-call facts read from gRPC metadata: caller identity, request id, priority.

Request ids are namespaced by caller inside the engine (``<caller>/<request_id>``), so two
callers may use the same id, ``Cancel`` can only reach the caller's own requests, and a
duplicate is reported only to the caller who owns the first one.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass

import grpc

from tokenwire.runtime.errors import ParameterError
from tokenwire.server.grpc.auth import authorization_values, bearer_token

MAX_REQUEST_ID_CHARS = 128


@dataclass(frozen=True)
class CallContext:
    caller: str  # short hash of the API key, or "anon" when the server is open
    request_id: str  # as the client knows it
    priority: int

    @property
    def internal_id(self) -> str:
        return internal_request_id(self.caller, self.request_id)


def internal_request_id(caller: str, request_id: str) -> str:
    return f"{caller}/{request_id}"


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for item in context.invocation_metadata() or ():
        if item.key == key:
            value = item.value
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def caller_of(context: grpc.aio.ServicerContext) -> str:
    """The caller's identity: a hash prefix of its bearer key (never the key itself), from
    the same header value the API-key check reads; "anon" without one."""
    metadata = context.invocation_metadata()
    if len(authorization_values(metadata)) > 1:
        raise ParameterError("authorization", "send at most one authorization header")
    token = bearer_token(metadata)
    if token is None:
        return "anon"
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def call_context(context: grpc.aio.ServicerContext, request_id: str = "") -> CallContext:
    """Request id from the message, else ``x-request-id``, else a fresh one."""
    rid = request_id or metadata_value(context, "x-request-id") or uuid.uuid4().hex
    if len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable():
        raise ParameterError(
            "request_id", f"must be printable and at most {MAX_REQUEST_ID_CHARS} characters"
        )
    raw_priority = metadata_value(context, "x-priority")
    try:
        priority = int(raw_priority) if raw_priority else 0
    except ValueError:
        raise ParameterError("x-priority", "must be an integer") from None
    return CallContext(caller_of(context), rid, priority)
