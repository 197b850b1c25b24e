"""Request plumbing shared by the shim's routes: the request id of a call, awaiting work
unless the HTTP client disconnects first (then its gRPC calls are cancelled), and the SSE
response that cancels its gRPC streams however it ends."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenwire.server.rest.errors import invalid
from tokenwire.server.rest.middleware import MAX_REQUEST_ID_CHARS, valid_request_id
from tokenwire.server.rest.upstream import OpenStreams

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it (and its gRPC
    calls), wait until the cancellation has run, and raise ``ClientGone``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    _consume(watcher)
    if not task.done():  # the client went away first
        task.cancel()  # takes effect when the task next runs: wait for that
        await asyncio.wait({task})
        _consume(task)
        raise ClientGone()
    return task.result()


def _consume(task: asyncio.Future[Any]) -> None:
    """Mark a finished task's exception as retrieved (asyncio logs unretrieved ones)."""
    if task.done() and not task.cancelled():
        task.exception()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """Streams the SSE body; cancels the gRPC calls however the response ends (even when
    the client is gone before the body iterator ever started)."""

    def __init__(self, streams: OpenStreams, content: Any, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.streams.cancel()


def request_id_of(request: Request, from_body: str | None) -> str:
    """The ``x-request-id`` header's id, else the body's ``request_id`` (vLLM's field; the
    header wins, as in vLLM), else the one the middleware made up."""
    if from_body is None or request.headers.get("x-request-id") is not None:
        return str(request.state.request_id)
    if not valid_request_id(from_body.encode()):
        raise invalid(
            "request_id",
            f"request_id must be printable ASCII, at most {MAX_REQUEST_ID_CHARS} characters",
        )
    return from_body
