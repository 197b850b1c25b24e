"""Routes of the Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}``,
``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``.

A response is one chat ``Generate`` (or ``GenerateStream``) on the gRPC API. With ``store``
(the default) it is kept per caller key (``store.py``) and its KV blocks stay on the server
under its id (``retain_kv_as``), as a Session keeps a turn's: a request naming it as
``previous_response_id`` renders the stored conversation plus its new input, and the prefix
already computed is a prefix hit (``usage.input_tokens_details.cached_tokens``). An unknown,
expired, deleted or another key's id is a 404 naming ``previous_response_id``, never a
silent recompute. Leaving the store (deleted, pushed out, expired) releases the blocks.
GET and DELETE check the key with the gRPC server first (a cheap ``ListModels``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenwire.server.rest.disconnect import SSEResponse, request_id_of, until_disconnect
from tokenwire.server.rest.errors import RestError, from_rpc_error
from tokenwire.server.rest.media_fetch import MediaFetchPolicy
from tokenwire.server.rest.remote_images import inline_response_images
from tokenwire.server.rest.responses_api.events import ResponseBuilder, ResponseEvents
from tokenwire.server.rest.responses_api.models import ResponsesRequest
from tokenwire.server.rest.responses_api.output import (
    JSON,
    new_id,
    output_calls,
    output_items,
    output_text,
    response_object,
    status_of,
    usage_body,
)
from tokenwire.server.rest.responses_api.store import (
    ResponseStore,
    StoredResponse,
    owner_of,
)
from tokenwire.server.rest.responses_api.translate import (
    Translated,
    output_message,
    translate,
)
from tokenwire.server.rest.upstream import CallOptions, OpenStreams, Upstream, call_options
from tokenwire.v1 import common_pb2, generation_pb2, models_pb2


def _not_found(response_id: str, param: str | None = None) -> RestError:
    return RestError(
        404,
        f"no stored response with id {response_id[:64]!r} (unknown, expired, deleted, or "
        "stored with another API key); send the full conversation as input instead",
        "not_found",
        param,
    )


class ResponsesRoutes:
    def __init__(
        self,
        upstream: Upstream,
        store: ResponseStore,
        timeout: float | None,
        media: MediaFetchPolicy | None = None,
    ) -> None:
        self.upstream = upstream
        self.media = media or MediaFetchPolicy()
        self.store = store
        self.timeout = timeout

    def install(self, app: FastAPI) -> None:
        app.add_api_route("/v1/responses", self.create, methods=["POST"])
        app.add_api_route("/v1/responses/{response_id}", self.get, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])
        app.add_api_route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"])

    # ------------------------------------------------------------------ create
    async def create(self, request: Request, body: ResponsesRequest) -> Response:
        body = await inline_response_images(body, self.media, len(await request.body()))
        owner = owner_of(request.headers.get("authorization"))
        history: list[common_pb2.ChatMessage] = []
        if body.previous_response_id is not None:
            previous = self.store.get(owner, body.previous_response_id)
            if previous is None or previous.body["status"] == "in_progress":
                raise _not_found(body.previous_response_id, "previous_response_id")
            history = previous.conversation
        store = body.store is not False and self.store.settings.max_count > 0
        response_id = new_id("resp")
        translated = translate(body, history, response_id if store else None)
        rid = request_id_of(request, body.request_id)
        options = call_options(request.headers, rid, self.timeout)
        created = int(time.time())

        def build(status: str, items: list[JSON], usage: JSON | None) -> JSON:
            return response_object(response_id, created, body, "", status, items, usage)

        record = StoredResponse(response_id, rid, build("in_progress", [], None), [])
        if store:
            await self._put(owner, record, options)
        try:
            if body.stream:
                opened = self.upstream.open_streams([translated.request], options)
                streams = await until_disconnect(request, opened)
            else:
                unary = self.upstream.generate_all([translated.request], options)
                responses = await until_disconnect(request, unary)
        except grpc.aio.AioRpcError as exc:
            self.store.delete(owner, response_id)  # the call failed: no KV was retained
            raise from_rpc_error(exc, translated.params) from None
        except BaseException:
            self.store.delete(owner, response_id)
            raise
        headers = {"x-request-id": rid}
        if body.stream:
            events = self._stream(streams, build, owner, record, translated, options)
            return SSEResponse(streams, events, {"cache-control": "no-cache", **headers})
        reply = responses[0]
        choice = reply.choices[0]
        items = output_items(choice)
        record.body = response_object(
            response_id,
            created,
            body,
            reply.model,
            status_of(choice.finish_reason),
            items,
            usage_body(reply.usage),
        )
        if store:
            await self._finish(owner, record, translated.conversation, options)
        return JSONResponse(record.body, headers=headers)

    async def _stream(
        self,
        streams: OpenStreams,
        build: ResponseBuilder,
        owner: str,
        record: StoredResponse,
        translated: Translated,
        options: CallOptions,
    ) -> AsyncIterator[bytes]:
        model = ""

        def named(status: str, items: list[JSON], usage: JSON | None) -> JSON:
            body = build(status, items, usage)
            return {**body, "model": model} if model else body

        events = ResponseEvents(named)
        finished = False
        try:
            yield events.start()
            try:
                async for _, event in streams.events():
                    kind = event.WhichOneof("event")
                    if kind == "start":
                        model = event.start.model
                    elif kind == "delta":
                        yield events.on_delta(event.delta)
                    elif kind == "end":
                        yield events.on_end(event.end)
                    elif kind == "usage":
                        yield events.finish(event.usage)
            except grpc.aio.AioRpcError as err:
                yield events.error(from_rpc_error(err, translated.params).body())
            record.body = named(events.status, events.items, events.usage)
            finished = True
            await self._finish(owner, record, translated.conversation, options)
        finally:
            if not finished and self.store.get(owner, record.id) is record:
                # the client went away mid-stream: its call was cancelled
                record.body = named("cancelled", events.items, events.usage)
                self.store.put(owner, record)

    async def _finish(
        self,
        owner: str,
        record: StoredResponse,
        conversation: list[common_pb2.ChatMessage],
        options: CallOptions,
    ) -> None:
        """Keep the finished response with its conversation (a continuation's history),
        unless it failed or was deleted meanwhile: then its KV blocks go too."""
        if self.store.get(owner, record.id) is not record or record.body["status"] == "failed":
            self.store.delete(owner, record.id)
            await self._release([record], options)
            return
        items = record.body["output"]
        reply = output_message(output_text(items), output_calls(items))
        record.conversation = [*conversation, reply]
        await self._put(owner, record, options)

    async def _put(self, owner: str, record: StoredResponse, options: CallOptions) -> None:
        record.retained = True  # the request runs with retain_kv_as = its id
        await self._release(self.store.put(owner, record), options)

    async def _drop(self, owner: str, response_id: str, options: CallOptions) -> None:
        gone = self.store.delete(owner, response_id)
        await self._release([gone] if gone is not None else [], options)

    async def _release(self, records: list[StoredResponse], options: CallOptions) -> None:
        keys = [r.id for r in records if r.retained]
        if not keys:
            return
        # On failure the engine's held-block budget reclaims them under pressure anyway.
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.upstream.generation.ReleaseKv(
                generation_pb2.ReleaseKvRequest(keys=keys),
                metadata=options.metadata,
                timeout=options.timeout or 10.0,
            )

    # ------------------------------------------------------------------ get / delete / cancel
    async def _checked_owner(self, request: Request) -> tuple[str, CallOptions]:
        """The caller's owner key, once the gRPC server accepted its key."""
        options = call_options(request.headers, request.state.request_id, 30.0)
        try:
            await self.upstream.models.ListModels(
                models_pb2.ListModelsRequest(), metadata=options.metadata, timeout=30.0
            )
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, {}) from None
        return owner_of(request.headers.get("authorization")), options

    async def get(self, request: Request, response_id: str) -> JSONResponse:
        owner, _ = await self._checked_owner(request)
        record = self.store.get(owner, response_id)
        if record is None:
            raise _not_found(response_id)
        return JSONResponse(record.body)

    async def delete(self, request: Request, response_id: str) -> JSONResponse:
        owner, options = await self._checked_owner(request)
        record = self.store.get(owner, response_id)
        if record is None:
            raise _not_found(response_id)
        if record.body["status"] == "in_progress":
            await self._cancel_call(record, options)
        await self._drop(owner, response_id, options)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, request: Request, response_id: str) -> JSONResponse:
        """Cancels a response still generating (its stream or call ends "cancelled"); a
        finished one is a 400, as at OpenAI."""
        owner, options = await self._checked_owner(request)
        record = self.store.get(owner, response_id)
        if record is None:
            raise _not_found(response_id)
        if record.body["status"] != "in_progress":
            raise RestError(
                400,
                f"cannot cancel a response whose status is {record.body['status']}",
                "invalid_value",
            )
        await self._cancel_call(record, options)
        return JSONResponse({**record.body, "status": "cancelled"})

    async def _cancel_call(self, record: StoredResponse, options: CallOptions) -> None:
        try:
            await self.upstream.generation.Cancel(
                generation_pb2.CancelRequest(request_id=record.request_id),
                metadata=options.metadata,
                timeout=30.0,
            )
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, {}) from None


def install_responses(
    app: FastAPI,
    upstream: Upstream,
    store: ResponseStore,
    timeout: float | None,
    media: MediaFetchPolicy | None = None,
) -> ResponsesRoutes:
    routes = ResponsesRoutes(upstream, store, timeout, media)
    routes.install(app)
    return routes
