"""``POST /v1/embeddings`` (OpenAI's shape) onto ``EmbeddingService.Embed``.

``input``: a string, a list of strings, a token-id array or a list of token-id arrays;
``encoding_format``: ``float`` (default) or ``base64`` (little-endian float32 bytes, as
OpenAI; the gRPC call asks for bytes and the shim only base64-encodes them); ``dimensions``
(Matryoshka models); ``model``; ``user`` (accepted, not interpreted). Values are checked by
the gRPC server, whose errors name the proto field; the shim maps them back to OpenAI's
(``texts`` / ``tokens`` -> ``input``). The shim holds no model.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import grpc
from fastapi import Request
from pydantic import Field

from tokenwire.server.rest.body_base import NonEmptyIds, _TextBody
from tokenwire.server.rest.disconnect import request_id_of, until_disconnect
from tokenwire.server.rest.errors import from_rpc_error
from tokenwire.server.rest.upstream import Upstream, call_options
from tokenwire.v1 import common_pb2, embeddings_pb2

I64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
_PARAMS = {"texts": "input", "tokens": "input", "dimensions": "dimensions", "model": "model"}


class EmbeddingRequest(_TextBody):
    input: str | list[str] | NonEmptyIds | list[list[Annotated[int, Field(ge=0, le=2**32 - 1)]]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: I64 | None = None
    user: str | None = None


def embed_message(body: EmbeddingRequest, request_id: str) -> embeddings_pb2.EmbedRequest:
    message = embeddings_pb2.EmbedRequest(
        model=body.model or "",
        request_id=request_id,
        user=body.user or "",
        encoding=embeddings_pb2.EMBEDDING_ENCODING_BYTES
        if body.encoding_format == "base64"
        else embeddings_pb2.EMBEDDING_ENCODING_FLOAT,
    )
    if body.dimensions is not None:
        message.dimensions = body.dimensions
    value: Any = body.input
    if isinstance(value, str):
        message.texts.texts.append(value)
    elif value and all(isinstance(v, int) for v in value):
        message.tokens.inputs.append(common_pb2.TokenIds(ids=value))
    elif value and all(isinstance(v, list) for v in value):
        message.tokens.inputs.extend(common_pb2.TokenIds(ids=v) for v in value)
    else:  # a list of strings (an empty list is the server's 400 naming ``input``)
        message.texts.texts.extend(value)
    return message


def embedding_body(
    reply: embeddings_pb2.EmbedResponse, encoding_format: str | None
) -> dict[str, Any]:
    data = []
    for item in reply.data:
        vector: Any
        if encoding_format == "base64":
            vector = base64.b64encode(item.data).decode("ascii")
        else:
            vector = list(item.values)
        data.append({"object": "embedding", "index": item.index, "embedding": vector})
    return {
        "object": "list",
        "data": data,
        "model": reply.model,
        "usage": {
            "prompt_tokens": reply.usage.prompt_tokens,
            "total_tokens": reply.usage.total_tokens,
        },
    }


async def embed(
    upstream: Upstream, request: Request, body: EmbeddingRequest, timeout: float | None
) -> tuple[dict[str, Any], str]:
    """(the OpenAI response body, the request id)."""
    rid = request_id_of(request, None)
    options = call_options(request.headers, rid, timeout)
    message = embed_message(body, rid)
    try:
        call = upstream.embeddings.Embed(
            message, metadata=options.metadata, timeout=options.timeout
        )
        reply = await until_disconnect(request, call)
    except grpc.aio.AioRpcError as err:
        error = from_rpc_error(err, _PARAMS)
        error.headers.update({"x-request-id": rid})
        raise error from None
    return embedding_body(reply, body.encoding_format), rid
