"""Undecodable request bytes -> INVALID_ARGUMENT ``MALFORMED_REQUEST``, never UNKNOWN.

grpc.aio decodes a request before any handler code runs and turns a ``DecodeError`` (garbage
bytes, invalid UTF-8 in a string field) into UNKNOWN with the exception's class name and an
ERROR traceback in the log. This interceptor gives every method of every service (tokenwire's,
health, reflection) a deserializer that never raises (it returns ``MALFORMED`` instead) and a
behaviour that answers that marker with INVALID_ARGUMENT and one WARNING line. tokenwire's
client-streaming methods read their messages through ``checked_messages``; other services'
get a request stream that aborts the call at the first undecodable message. It sits inside
the API-key check, so a caller without a valid key gets UNAUTHENTICATED first, whatever it
sent.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from tokenwire.server.grpc.errors import ServiceError, abort
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


Prepare = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _guarded(behaviour: Callable[..., Any], prepare: Prepare) -> Callable[..., Any]:
    """``behaviour`` run on ``prepare``'s version of the request, of the same kind: an async
    generator stays one, a coroutine (a unary answer, or a stream written with
    ``context.write`` as health's Watch does) stays one."""
    if inspect.isasyncgenfunction(behaviour):

        async def stream_out(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in behaviour(await prepare(request, context), context):
                yield item

        return stream_out

    async def answer(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(await prepare(request, context), context)

    return answer


def guard(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    codec = dict(
        request_deserializer=_lenient(handler.request_deserializer, method),
        response_serializer=handler.response_serializer,
    )
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_guarded(handler.unary_unary, _checked), **codec)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _guarded(handler.unary_stream, _checked), **codec
        )
    own = method.startswith(OWN_PREFIX)  # reads its messages through ``checked_messages``
    if handler.stream_unary is not None:
        behaviour = handler.stream_unary if own else _guarded(handler.stream_unary, _stream_of)
        return grpc.stream_unary_rpc_method_handler(behaviour, **codec)
    behaviour = handler.stream_stream if own else _guarded(handler.stream_stream, _stream_of)
    return grpc.stream_stream_rpc_method_handler(behaviour, **codec)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return guard(handler, handler_call_details.method or "")
