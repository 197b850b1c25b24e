"""The OpenAI-compatible FastAPI app: routes, error handlers, middlewares.

Holds no model, tokenizer or engine: every route is a translation onto the ``tokenwire.v1``
gRPC API through ``Upstream``. Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/embeddings`` (``EmbeddingService.Embed``; ``rest/embeddings``), ``POST /v1/score``,
``/v1/rerank`` and ``/v2/rerank`` (``EmbeddingService.Score``; ``rest/score``),
``GET /v1/models`` (with the serving replica's ``replica_id``), ``GET /v1/models/{model}``
(the base model and its LoRA adapters, each adapter with the base as ``parent``), vLLM's
``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (onto ``ModelService.LoadAdapter`` / ``UnloadAdapter``: the
gRPC server decides on the flag, the key and the path; success is vLLM's plain-text line),
``GET /health`` (the shim is up) and ``GET /ready`` (the gRPC server reports SERVING),
``GET /openapi.json``, SageMaker's ``/ping`` and ``/invocations`` and vLLM's ``/version``
(``rest/sagemaker``), and ``GET /metrics`` (Prometheus text) when the host process provides
metrics (behind the API key when keys are set). Errors always use the OpenAI envelope (never
FastAPI's 422); a client that disconnects cancels its gRPC calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from tokenwire.server.api_keys import KeyCheck, KeyChecker, bearer_of
from tokenwire.server.rest.disconnect import (
    ClientGone,
    SSEResponse,
    request_id_of,
    until_disconnect,
)
from tokenwire.server.rest.echo import resolve_echo
from tokenwire.server.rest.embeddings import EmbeddingRequest, embed
from tokenwire.server.rest.errors import (
    RestError,
    clip,
    from_rpc_error,
    from_validation_errors,
)
from tokenwire.server.rest.media_fetch import MediaFetchPolicy
from tokenwire.server.rest.middleware import (
    BodyLimitMiddleware,
    RequestIdMiddleware,
)
from tokenwire.server.rest.models import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from tokenwire.server.rest.openapi import install_openapi
from tokenwire.server.rest.remote_images import inline_chat_images
from tokenwire.server.rest.requests import Translated, chat_request, completion_requests
from tokenwire.server.rest.responses import (
    JSON,
    OutputFlags,
    chat_response,
    completion_response,
)
from tokenwire.server.rest.responses_api.routes import install_responses
from tokenwire.server.rest.responses_api.store import ResponsesSettings, ResponseStore
from tokenwire.server.rest.sagemaker import install_sagemaker
from tokenwire.server.rest.score import install_score
from tokenwire.server.rest.stream import ChatChunks, CompletionChunks, StreamSpec, sse_events
from tokenwire.server.rest.tokenize import install_tokenize
from tokenwire.server.rest.upstream import Upstream, call_options
from tokenwire.v1 import models_pb2

T = TypeVar("T")
logger = logging.getLogger("tokenwire.rest")
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
_MODEL_PARAMS = {"model": "model"}
_ADAPTER_PARAMS = {"lora_name": "lora_name", "lora_path": "lora_path"}
ADAPTER_TIMEOUT = 600.0  # seconds: loading reads and checks the adapter's weights


@dataclass(frozen=True)
class RestSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 2 << 20
    request_timeout: float | None = None  # gRPC deadline per request, seconds
    # Prometheus text for ``GET /metrics`` (``tokenwire serve`` passes its registry's).
    metrics: Callable[[], bytes] | None = None
    # With keys, ``GET /metrics`` needs ``authorization: Bearer <key>`` like every gRPC call.
    metrics_api_keys: tuple[str, ...] = ()
    # Or any key the server's tenant registry knows (``--api-key-file``; reloadable).
    metrics_keys: KeyCheck | None = None
    # Stored responses of the Responses API (``--responses-max-*``).
    responses: ResponsesSettings = field(default_factory=ResponsesSettings)
    # Remote image URLs fetched (``--allowed-media-domains``; default: none).
    media: MediaFetchPolicy = field(default_factory=MediaFetchPolicy)


class Routes:
    def __init__(self, upstream: Upstream, settings: RestSettings) -> None:
        self.upstream = upstream
        self.settings = settings
        self._metrics_keys: KeyCheck = settings.metrics_keys or KeyChecker(
            settings.metrics_api_keys
        )
        self.started = int(time.time())

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        body = await inline_chat_images(body, self.settings.media, len(await request.body()))
        return await self._generate(request, chat_request(body), bool(body.stream), "chat")

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        translated = completion_requests(body)
        return await self._generate(request, translated, bool(body.stream), "completion")

    async def _generate(
        self, request: Request, translated: Translated, stream: bool, kind: str
    ) -> Response:
        rid = request_id_of(request, translated.request_id)
        timeout = self.settings.request_timeout
        options = call_options(request.headers, rid, timeout)
        id_header = {"x-request-id": rid}
        upstream = self.upstream
        flags = OutputFlags(
            translated.prompt_logprobs,
            translated.token_ids_names,
            await resolve_echo(translated.echo, translated.requests, upstream, options),
        )
        response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{rid}"
        created = int(time.time())
        try:
            if stream:
                opened = upstream.open_streams(translated.requests, options)
                streams = await until_disconnect(request, opened)
            else:
                unary = upstream.generate_all(translated.requests, options)
                responses = await until_disconnect(request, unary)
        except grpc.aio.AioRpcError as err:
            error = from_rpc_error(err, translated.params)
            error.headers.update(id_header)
            raise error from None
        if not stream:
            if kind == "chat":
                body = chat_response(
                    response_id,
                    created,
                    responses[0],
                    translated.logprobs,
                    translated.named_tool,
                    flags,
                )
            else:
                body = completion_response(
                    response_id, created, responses, translated.n, translated.logprobs, flags
                )
            return JSONResponse(body, headers=id_header)
        spec = StreamSpec(
            response_id,
            created,
            translated.n,
            translated.logprobs,
            translated.include_usage,
            translated.named_tool,
            translated.continuous_usage,
            flags,
        )
        chunks = ChatChunks(spec) if kind == "chat" else CompletionChunks(spec)
        events = sse_events(streams, chunks, translated.params)
        return SSEResponse(streams, events, {"cache-control": "no-cache", **id_header})

    async def embeddings(self, request: Request, body: EmbeddingRequest) -> JSONResponse:
        payload, rid = await embed(self.upstream, request, body, self.settings.request_timeout)
        return JSONResponse(payload, headers={"x-request-id": rid})

    async def list_models(self, request: Request) -> JSONResponse:
        reply = await self._models_call(request, "ListModels", models_pb2.ListModelsRequest())
        server = await self._models_call(
            request, "GetServerInfo", models_pb2.GetServerInfoRequest()
        )
        data = [{**self._model(m), "replica_id": server.replica_id} for m in reply.models]
        # replica_id (tokenwire's): which server answered, for fleets behind a gateway.
        return JSONResponse({"object": "list", "data": data, "replica_id": server.replica_id})

    async def get_model(self, request: Request, model: str) -> JSONResponse:
        info_request = models_pb2.GetModelInfoRequest(model=model)
        return JSONResponse(
            self._model(await self._models_call(request, "GetModelInfo", info_request))
        )

    async def load_lora_adapter(self, request: Request, body: LoadLoRAAdapterRequest) -> Response:
        message = models_pb2.LoadAdapterRequest(lora_name=body.lora_name, lora_path=body.lora_path)
        await self._models_call(request, "LoadAdapter", message, _ADAPTER_PARAMS, ADAPTER_TIMEOUT)
        return PlainTextResponse(
            f"Success: LoRA adapter '{clip(body.lora_name)}' added successfully."
        )

    async def unload_lora_adapter(
        self, request: Request, body: UnloadLoRAAdapterRequest
    ) -> Response:
        message = models_pb2.UnloadAdapterRequest(lora_name=body.lora_name)
        await self._models_call(request, "UnloadAdapter", message, _ADAPTER_PARAMS, ADAPTER_TIMEOUT)
        return PlainTextResponse(
            f"Success: LoRA adapter '{clip(body.lora_name)}' removed successfully."
        )

    async def _models_call(
        self,
        request: Request,
        method: str,
        message: Any,
        params: dict[str, str] = _MODEL_PARAMS,
        timeout: float = 30.0,
    ) -> Any:
        options = call_options(request.headers, request.state.request_id, timeout)
        try:
            return await getattr(self.upstream.models, method)(
                message, metadata=options.metadata, timeout=options.timeout
            )
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, params) from None

    def _model(self, info: models_pb2.ModelInfo) -> JSON:
        return {
            "id": info.name,
            "object": "model",
            "created": self.started,
            "owned_by": "tokenwire",
            "root": info.name,
            "parent": info.parent or None,  # a LoRA adapter: the base model's name
            "max_model_len": info.max_context_tokens,
            # tokenwire's additions (vLLM-style extra fields; OpenAI clients ignore them).
            "quantization": info.quantization or None,
            "weight_bytes": info.weight_bytes,
            "kv_bytes_per_token": info.kv_bytes_per_token or None,
            "tensor_parallel_size": info.tensor_parallel_size,
            "task": info.task or "generate",  # "embed": POST /v1/embeddings serves it
            "embedding_dimensions": info.embedding_dimensions or None,
        }

    async def metrics(self, request: Request) -> Response:
        assert self.settings.metrics is not None
        if self.settings.metrics_api_keys or self.settings.metrics_keys is not None:
            token = bearer_of(request.headers.getlist("authorization"))
            if not self._metrics_keys.is_valid(token):
                raise RestError(
                    401,
                    "missing or invalid API key (authorization: Bearer <key>)",
                    "invalid_api_key",
                )
        body = self.settings.metrics()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def ready(self) -> JSONResponse:
        if await self.upstream.serving():
            return JSONResponse({"status": "ready"})
        raise RestError(503, "the inference server is not ready", "not_ready")


def _error_response(err: RestError) -> JSONResponse:
    return JSONResponse(err.body(), err.status, headers=err.response_headers())


async def _on_rest_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RestError)
    return _error_response(exc)


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return _error_response(from_validation_errors(exc.errors()))


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, "invalid_request")
    err = RestError(exc.status_code, str(exc.detail), code, headers=dict(exc.headers or {}))
    return _error_response(err)


async def _on_client_gone(request: Request, exc: Exception) -> Response:
    logger.debug(
        "client disconnected before the response (request_id=%s); its gRPC calls were cancelled",
        request.state.request_id,
    )
    return Response(status_code=499)  # nobody reads it: the client is gone


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    logger.error("unexpected error (request_id=%s)", request.state.request_id, exc_info=exc)
    return _error_response(RestError(500, "internal error", "internal_error"))


def create_app(upstream: Upstream, settings: RestSettings) -> FastAPI:
    # A request's fetched images count with its body against --max-request-body-bytes.
    media = replace(settings.media, max_request_bytes=settings.max_body_bytes)
    settings = replace(settings, media=media)
    app = FastAPI(
        title="tokenwire OpenAI-compatible API",
        version="1",
        docs_url=None,
        redoc_url=None,
    )
    routes = Routes(upstream, settings)
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/embeddings", routes.embeddings, methods=["POST"])
    app.add_api_route("/v1/models", routes.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", routes.get_model, methods=["GET"])
    app.add_api_route("/v1/load_lora_adapter", routes.load_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", routes.unload_lora_adapter, methods=["POST"])
    install_responses(
        app, upstream, ResponseStore(settings.responses), settings.request_timeout, settings.media
    )
    install_score(app, upstream, settings.request_timeout)  # /v1/score, /v1/rerank, /v2/rerank
    install_tokenize(app, routes._models_call)  # /tokenize, /detokenize, the render routes
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/ready", routes.ready, methods=["GET"])
    install_sagemaker(app, routes.ready)  # /ping, /invocations (over the routes above), /version
    if settings.metrics is not None:
        app.add_api_route("/metrics", routes.metrics, methods=["GET"], include_in_schema=False)
    app.add_exception_handler(RestError, _on_rest_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(ClientGone, _on_client_gone)
    app.add_exception_handler(Exception, _on_unexpected)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(RequestIdMiddleware)  # outermost: every response carries the id
    install_openapi(app)
    return app
