"""``POST /v1/score`` and ``POST /v1/rerank`` / ``/v2/rerank`` (vLLM's shapes, Jina / Cohere
compatible) onto ``EmbeddingService.Score`` (a cross-encoder: ``--task score``).

``/v1/score``: ``text_1`` / ``text_2`` (a string or a list each: one ``text_1`` against
every ``text_2``, or equal-length lists by index) -> ``data[{index, object: "score",
score}]`` in pair order. Rerank: ``query`` and ``documents`` -> ``results[{index, document:
{text}, relevance_score}]`` sorted by score (highest first), the best ``top_n`` of them
(absent or 0: all), without ``document`` when ``return_documents`` is false. Values are
checked by the gRPC server, whose errors name the proto field; the shim maps them back
(rerank: ``text_1`` -> ``query``, ``text_2`` -> ``documents``). The shim holds no model.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from tokenwire.server.rest.body_base import _TextBody
from tokenwire.server.rest.disconnect import request_id_of, until_disconnect
from tokenwire.server.rest.errors import from_rpc_error
from tokenwire.server.rest.upstream import Upstream, call_options
from tokenwire.v1 import embeddings_pb2

_SCORE_PARAMS = {"text_1": "text_1", "text_2": "text_2", "model": "model"}
_RERANK_PARAMS = {"text_1": "query", "text_2": "documents", "model": "model"}


class ScoreRequest(_TextBody):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    user: str | None = None


class RerankRequest(_TextBody):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    return_documents: bool = True
    user: str | None = None


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


async def _score(
    upstream: Upstream,
    request: Request,
    message: embeddings_pb2.ScoreRequest,
    params: dict[str, str],
    timeout: float | None,
) -> tuple[embeddings_pb2.ScoreResponse, str]:
    rid = request_id_of(request, None)
    options = call_options(request.headers, rid, timeout)
    message.request_id = rid
    try:
        call = upstream.embeddings.Score(
            message, metadata=options.metadata, timeout=options.timeout
        )
        reply: embeddings_pb2.ScoreResponse = await until_disconnect(request, call)
    except grpc.aio.AioRpcError as err:
        error = from_rpc_error(err, params)
        error.headers.update({"x-request-id": rid})
        raise error from None
    return reply, rid


def score_body(reply: embeddings_pb2.ScoreResponse) -> dict[str, Any]:
    return {
        "id": f"score-{reply.request_id}",
        "object": "list",
        "created": int(time.time()),
        "model": reply.model,
        "data": [{"index": d.index, "object": "score", "score": d.score} for d in reply.data],
        "usage": {
            "prompt_tokens": reply.usage.prompt_tokens,
            "total_tokens": reply.usage.total_tokens,
        },
    }


def rerank_body(reply: embeddings_pb2.ScoreResponse, body: RerankRequest) -> dict[str, Any]:
    """Results by score, highest first (ties: document order), the best ``top_n``."""
    ranked = sorted(reply.data, key=lambda d: (-d.score, d.index))
    if body.top_n:
        ranked = ranked[: body.top_n]
    results = []
    for d in ranked:
        item: dict[str, Any] = {"index": d.index, "relevance_score": d.score}
        if body.return_documents:
            item["document"] = {"text": body.documents[d.index]}
        results.append(item)
    return {
        "id": f"rerank-{reply.request_id}",
        "model": reply.model,
        "usage": {"total_tokens": reply.usage.total_tokens},
        "results": results,
    }


class ScoreRoutes:
    def __init__(self, upstream: Upstream, timeout: float | None) -> None:
        self.upstream = upstream
        self.timeout = timeout

    async def score(self, request: Request, body: ScoreRequest) -> JSONResponse:
        message = embeddings_pb2.ScoreRequest(
            model=body.model or "",
            text_1=_as_list(body.text_1),
            text_2=_as_list(body.text_2),
            user=body.user or "",
        )
        reply, rid = await _score(self.upstream, request, message, _SCORE_PARAMS, self.timeout)
        return JSONResponse(score_body(reply), headers={"x-request-id": rid})

    async def rerank(self, request: Request, body: RerankRequest) -> JSONResponse:
        message = embeddings_pb2.ScoreRequest(
            model=body.model or "",
            text_1=[body.query],
            text_2=body.documents,
            user=body.user or "",
        )
        reply, rid = await _score(self.upstream, request, message, _RERANK_PARAMS, self.timeout)
        return JSONResponse(rerank_body(reply, body), headers={"x-request-id": rid})


def install_score(app: FastAPI, upstream: Upstream, timeout: float | None) -> None:
    routes = ScoreRoutes(upstream, timeout)
    app.add_api_route("/v1/score", routes.score, methods=["POST"])
    app.add_api_route("/v1/rerank", routes.rerank, methods=["POST"])
    app.add_api_route("/v2/rerank", routes.rerank, methods=["POST"])
