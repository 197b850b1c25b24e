"""Undecodable request bytes -> INVALID_ARGUMENT ``MALFORMED_REQUEST``, never UNKNOWN.

grpc.aio decodes a request before any handler code runs and turns a ``DecodeError`` (garbage
bytes, invalid UTF-8 in a string field) into UNKNOWN with the exception's class name and an
ERROR traceback in the log. This interceptor gives every method of every service (tokenwire's,
health, reflection) a deserializer that never raises (it returns ``MALFORMED`` instead) and a
behaviour that answers that marker with INVALID_ARGUMENT and one WARNING line. tokenwire's
client-streaming methods read their messages through ``checked_messages``; other services'
get a request stream that aborts the call at the first undecodable message. It sits inside
the API-key check, so a caller without a valid key gets UNAUTHENTICATED first, whatever it
sent. The same wrapper checks every reply against the send limit (``send_limit``): a reply
too large to send ends the call RESOURCE_EXHAUSTED RESPONSE_TOO_LARGE instead of grpc-core's
bare status and ExecuteBatchError traceback.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from tokenwire.server.grpc.errors import ServiceError, abort
from tokenwire.server.grpc.send_limit import check_size
from tokenwire.v1 import errors_pb2

# Methods whose client streams go through ``checked_messages`` (the handler maps the error).
OWN_PREFIX = "/tokenwire."
logger = logging.getLogger("tokenwire.server")


class _Malformed:
    """Stands in for a request message whose bytes did not decode."""

    def __repr__(self) -> str:
        return "MALFORMED"


MALFORMED = _Malformed()


def malformed_error() -> ServiceError:
    return ServiceError(
        grpc.StatusCode.INVALID_ARGUMENT,
        errors_pb2.ERROR_REASON_MALFORMED_REQUEST,
        "the request message could not be decoded (not a valid protobuf of this method's "
        "request type, or a string field holding invalid UTF-8)",
    )


def _lenient(deserializer: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if deserializer is None:
            return data
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, UnicodeDecodeError, ...
            logger.warning(
                "malformed request: %s (%d bytes, %s)", method, len(data), type(exc).__name__
            )
            return MALFORMED

    return parse


async def checked_messages(requests: Any) -> AsyncIterator[Any]:
    """A client stream that raises ``malformed_error()`` at the first undecodable message."""
    async for message in requests:
        if message is MALFORMED:
            raise malformed_error()
        yield message


async def _aborting(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    """A client stream that ends the call INVALID_ARGUMENT at the first undecodable message."""
    async for message in requests:
        if message is MALFORMED:
            await abort(context, malformed_error())
        yield message


async def _checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
    if request is MALFORMED:
        await abort(context, malformed_error())
    return request


async def _stream_of(requests: Any, context: grpc.aio.ServicerContext) -> Any:
    return _aborting(requests, context)


async def _as_is(requests: Any, context: grpc.aio.ServicerContext) -> Any:
    return requests


async def _fits(reply: Any, context: grpc.aio.ServicerContext, limit: int | None) -> None:
    """End the call RESOURCE_EXHAUSTED when ``reply`` is over the send limit (grpc-core would
    fail it with a bare status and an ExecuteBatchError traceback)."""
    if isinstance(reply, Message):
        try:
            check_size(reply, limit)
        except ServiceError as err:
            await abort(context, err)


Prepare = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _guarded(
    behaviour: Callable[..., Any], prepare: Prepare, limit: int | None
) -> Callable[..., Any]:
    """``behaviour`` run on ``prepare``'s version of the request, each reply checked against
    the send limit, of the same kind: an async generator stays one, a coroutine (a unary
    answer, or a stream written with ``context.write`` as health's Watch does) stays one."""
    if inspect.isasyncgenfunction(behaviour):

        async def stream_out(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            replies = behaviour(await prepare(request, context), context)
            try:
                async for reply in replies:
                    await _fits(reply, context, limit)
                    yield reply
            finally:
                await replies.aclose()  # its own clean-up runs now, not when collected

        return stream_out

    async def answer(request: Any, context: grpc.aio.ServicerContext) -> Any:
        reply = await behaviour(await prepare(request, context), context)
        await _fits(reply, context, limit)
        return reply

    return answer


def guard(
    handler: grpc.RpcMethodHandler, method: str, limit: int | None = None
) -> grpc.RpcMethodHandler:
    codec = dict(
        request_deserializer=_lenient(handler.request_deserializer, method),
        response_serializer=handler.response_serializer,
    )
    if handler.unary_unary is not None:
        behaviour = _guarded(handler.unary_unary, _checked, limit)
        return grpc.unary_unary_rpc_method_handler(behaviour, **codec)
    if handler.unary_stream is not None:
        behaviour = _guarded(handler.unary_stream, _checked, limit)
        return grpc.unary_stream_rpc_method_handler(behaviour, **codec)
    # tokenwire's own methods read their messages through ``checked_messages``.
    stream_in = _as_is if method.startswith(OWN_PREFIX) else _stream_of
    if handler.stream_unary is not None:
        behaviour = _guarded(handler.stream_unary, stream_in, limit)
        return grpc.stream_unary_rpc_method_handler(behaviour, **codec)
    behaviour = _guarded(handler.stream_stream, stream_in, limit)
    return grpc.stream_stream_rpc_method_handler(behaviour, **codec)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """The guard on every method; ``max_response_bytes``: the server's send limit."""

    def __init__(self, max_response_bytes: int | None = None) -> None:
        self.max_response_bytes = max_response_bytes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method or ""
        return guard(handler, method, self.max_response_bytes)
