"""API-key authentication: a grpc.aio interceptor that runs before any handler work.

Every RPC except ``grpc.health.v1.Health`` needs ``authorization: Bearer <key>`` when keys
are configured. Keys are compared in constant time against every configured key; neither the
key nor the header ever appears in a log or an error message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from tokenwire.server.api_keys import KeyCheck, bearer_of
from tokenwire.server.grpc.errors import ServiceError, abort
from tokenwire.v1 import errors_pb2

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
UNAUTHENTICATED = ServiceError(
    grpc.StatusCode.UNAUTHENTICATED,
    errors_pb2.ERROR_REASON_API_KEY_INVALID,
    "missing or invalid API key (send exactly one header authorization: Bearer <key>)",
)


def authorization_values(metadata: Any) -> list[str]:
    """Every ``authorization`` value of the call's metadata, in order."""
    values = []
    for key, value in metadata or ():
        if key == "authorization":
            values.append(value.decode("latin-1") if isinstance(value, bytes) else str(value))
    return values


def bearer_token(metadata: Any) -> str | None:
    """The key of the call's one ``authorization: Bearer <key>`` header (scheme matched
    case-insensitively, RFC 7235); None when absent, malformed or sent more than once. Both
    the key check and the caller identity use this one value."""
    return bearer_of(authorization_values(metadata))


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without one valid ``authorization: Bearer <key>`` header. ``keys``
    is read per call (the tenant registry: a SIGHUP reload takes effect at once)."""

    def __init__(self, keys: KeyCheck) -> None:
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        if self.keys.is_valid(bearer_token(handler_call_details.invocation_metadata)):
            return handler
        return _denying(handler)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape that fails with UNAUTHENTICATED before reading anything."""

    async def unary_out(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(context, UNAUTHENTICATED)

    async def stream_out(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await abort(context, UNAUTHENTICATED)
        yield  # pragma: no cover - makes this an async generator

    # The request is never parsed: a refused caller learns nothing from its bytes.
    codec = dict(
        request_deserializer=_ignore,
        response_serializer=handler.response_serializer,
    )
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary_out, **codec)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream_out, **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary_out, **codec)
    return grpc.stream_stream_rpc_method_handler(stream_out, **codec)


def _ignore(data: bytes) -> None:
    return None
