"""Amazon SageMaker's container contract, as vLLM serves it: ``GET``/``POST /ping`` and
``POST /invocations``; and vLLM's ``GET /version``.

``/ping`` answers 200 ``{"status": "ready"}`` once the gRPC server reports SERVING and 503
before (SageMaker routes traffic only to a container whose ping succeeds: ``/ready``'s rule).
``/invocations`` takes any body the other routes take and hands the request to the route its
fields name, in vLLM's order: ``messages`` -> ``/v1/chat/completions``, ``prompt`` ->
``/v1/completions``, ``input`` -> ``/v1/embeddings``, ``text_1`` -> ``/v1/score``, ``query``
with ``documents`` -> ``/v1/rerank``. That route's own handler runs on the same request (its
validation, errors, streaming and disconnect handling); a JSON object that names none of
them is a 400 naming ``body``. ``/version``: ``{"version": <tokenwire's version>}``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from tokenwire.server.rest.errors import invalid

# (a field every body of the route has, another it must have too or None, the route)
_DISPATCH: tuple[tuple[str, str | None, str], ...] = (
    ("messages", None, "/v1/chat/completions"),
    ("prompt", None, "/v1/completions"),
    ("input", None, "/v1/embeddings"),
    ("text_1", None, "/v1/score"),
    ("query", "documents", "/v1/rerank"),
)
Handler = Callable[[Request], Awaitable[Response]]


def invocation_route(body: Any) -> str:
    """The route an ``/invocations`` body goes to; a 400 naming ``body`` when none fits."""
    if isinstance(body, dict):
        for field, also, path in _DISPATCH:
            if field in body and (also is None or also in body):
                return path
    fields = ", ".join(f if a is None else f"{f} with {a}" for f, a, _ in _DISPATCH)
    raise invalid("body", f"an invocation needs a JSON object with one of: {fields}")


def _version() -> str:
    try:
        return version("tokenwire")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def install_sagemaker(app: FastAPI, ready: Callable[[], Awaitable[Response]]) -> None:
    """``/ping`` (``ready``: the ``/ready`` handler), ``/invocations`` over ``app``'s POST
    routes (looked up when called: every route is installed by then), ``/version``."""
    handlers: dict[str, Handler] = {}

    def handler(path: str) -> Handler:
        if path not in handlers:
            for route in app.routes:
                if (
                    isinstance(route, APIRoute)
                    and route.path == path
                    and "POST" in (route.methods or ())
                ):
                    handlers[path] = route.get_route_handler()
        return handlers[path]

    async def invocations(request: Request) -> Response:
        try:
            body = json.loads(await request.body())  # cached: the route reads it again
        except (ValueError, UnicodeDecodeError):
            raise invalid("body", "the body is not valid JSON") from None
        return await handler(invocation_route(body))(request)

    async def show_version() -> JSONResponse:
        return JSONResponse({"version": _version()})

    for method in ("GET", "POST"):  # one operation id each in the OpenAPI schema
        app.add_api_route("/ping", ready, methods=[method], operation_id=f"ping_{method.lower()}")
    app.add_api_route("/invocations", invocations, methods=["POST"])
    app.add_api_route("/version", show_version, methods=["GET"])
