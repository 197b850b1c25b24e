"""Per-call facts read from gRPC metadata: caller identity (tenant), request id, priority.

Request ids are namespaced by caller inside the engine (``<caller>/<request_id>``: per tenant
of ``--api-key-file``, per key of ``--api-key``), so two tenants may use the same id,
``Cancel`` can only reach the tenant's own requests, and a duplicate is reported only to the
tenant who owns the first one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import grpc

from tokenwire.runtime.errors import ParameterError
from tokenwire.server.grpc.auth import UNAUTHENTICATED, authorization_values, bearer_token
from tokenwire.server.tenants.registry import Caller, TenantRegistry

MAX_REQUEST_ID_CHARS = 128
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class CallContext:
    caller: str  # the request-id namespace: the tenant's, or "anon" when the server is open
    request_id: str  # as the client knows it
    priority: int  # after the tenant's max_priority clamp
    who: Caller  # the tenant as admitted (a reload later does not change it)

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


def identify(context: grpc.aio.ServicerContext, tenants: TenantRegistry) -> Caller:
    """The caller's tenant, from the same header value the API-key check reads. Its
    namespace is never the key nor anything derived from it: a tenant's name, the position
    of an ``--api-key`` key among those flags, or "anon" when the server is open."""
    metadata = context.invocation_metadata()
    if len(authorization_values(metadata)) > 1:
        raise ParameterError("authorization", "send at most one authorization header")
    caller = tenants.identify(bearer_token(metadata))
    if caller is None:  # the key was dropped by a reload since the interceptor checked it
        raise UNAUTHENTICATED
    return caller


def caller_of(context: grpc.aio.ServicerContext, tenants: TenantRegistry) -> str:
    return identify(context, tenants).namespace


def call_context(
    context: grpc.aio.ServicerContext,
    tenants: TenantRegistry,
    request_id: str = "",
    priority_field: int | None = None,
) -> CallContext:
    """Request id from the message, else ``x-request-id``, else a fresh one. Priority from
    ``x-priority``, else the message's ``priority`` field (``priority_field``), else 0."""
    rid = request_id or metadata_value(context, "x-request-id") or uuid.uuid4().hex
    if len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable():
        raise ParameterError(
            "request_id", f"must be printable and at most {MAX_REQUEST_ID_CHARS} characters"
        )
    raw_priority = metadata_value(context, "x-priority")
    try:
        priority = int(raw_priority) if raw_priority else (priority_field or 0)
    except ValueError:
        raise ParameterError("x-priority", "must be an integer") from None
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:  # what the engine's wire carries
        raise ParameterError("x-priority", "must be an integer in [-2**63, 2**63 - 1]")
    who = identify(context, tenants)
    return CallContext(who.namespace, rid, who.tenant.clamp_priority(priority), who)
