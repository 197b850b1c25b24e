"""Pure-ASGI middlewares of the REST shim: request ids and the request body size limit.

``RequestIdMiddleware`` takes the caller's ``x-request-id`` (or makes one), stores it in
``request.state.request_id`` and returns it as the ``x-request-id`` response header on every
response, errors included. An id that is not printable ASCII or is longer than 128 characters
(the gRPC server's rule: the id travels as gRPC metadata) is a 400 naming the header, sent with
a fresh id. ``BodyLimitMiddleware`` answers 413 when ``content-length`` is over the limit, and
stops reading a chunked body as soon as it grows past it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenwire.server.rest.errors import RestError, invalid

REQUEST_ID_HEADER = b"x-request-id"
# The gRPC server takes ids of up to 128 characters; a request with several prompts sends
# ``<id>-<prompt index>`` per prompt (up to 256 prompts: 4 more characters).
MAX_REQUEST_ID_CHARS = 128 - len("-255")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = _header(scope, REQUEST_ID_HEADER)
        if raw and not valid_request_id(raw):
            await _send_error(send, bad_request_id(), {"x-request-id": uuid.uuid4().hex})
            return
        request_id = raw.decode("ascii") if raw else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        encoded = request_id.encode("ascii")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(k.lower() == REQUEST_ID_HEADER for k, _ in headers):
                    headers.append((REQUEST_ID_HEADER, encoded))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def valid_request_id(raw: bytes) -> bool:
    text = raw.decode("latin-1")
    return len(text) <= MAX_REQUEST_ID_CHARS and text.isascii() and text.isprintable()


def bad_request_id() -> RestError:
    return invalid(
        "x-request-id",
        f"header x-request-id must be printable ASCII, at most {MAX_REQUEST_ID_CHARS} characters",
        "invalid_header",
    )


def too_large(limit: int) -> RestError:
    return RestError(413, f"the request body exceeds {limit} bytes", "request_too_large")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _send_error(send, too_large(self.limit))
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # FastAPI passes HTTPExceptions raised while reading the body through.
                    raise HTTPException(413, too_large(self.limit).message)
            return message

        await self.app(scope, limited_receive, send)


async def _send_error(send: Send, error: RestError, extra: dict[str, str] | None = None) -> None:
    body = json.dumps(error.body()).encode()
    headers: list[Any] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.encode(), v.encode()) for k, v in (extra or {}).items()),
    ]  # uvicorn discards the unread body, so the client can finish sending and read this
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
