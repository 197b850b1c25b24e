"""vLLM's tokenizer and render endpoints on the shim, onto ``ModelService.Tokenize`` /
``Detokenize`` (the shim holds no tokenizer):

- ``POST /tokenize``: ``{"prompt": ...}`` or ``{"messages": [...]}`` (chat template, generation
  prompt included) -> ``{"count", "max_model_len", "tokens", "token_strs"}``;
- ``POST /detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": text}``;
- ``POST /v1/chat/completions/render``: a chat completion body -> vLLM's ``GenerateRequest``
  shape ``{"request_id", "token_ids", "features", "sampling_params", "model", "stream",
  "stream_options", "cache_salt", "priority", "kv_transfer_params"}``, nothing generated;
- ``POST /v1/completions/render``: a completion body -> a list of those, one per prompt.
Bad input is a 400 naming the field, as on every route.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tokenwire.server.rest.body_base import U32_MAX
from tokenwire.server.rest.errors import invalid
from tokenwire.server.rest.models import ChatCompletionRequest, ChatMessage, CompletionRequest
from tokenwire.server.rest.requests import chat_request, completion_requests
from tokenwire.v1 import models_pb2

# vLLM's SamplingParams fields a render response echoes (those the body set).
SAMPLING_KEYS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens", "stop",
    "stop_token_ids", "ignore_eos", "logprobs", "skip_special_tokens",
)  # fmt: skip
_TOKENIZE_PARAMS = {"model": "model", "text": "prompt", "chat": "messages"}
_DETOKENIZE_PARAMS = {"model": "model", "token_ids": "tokens"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class TokenizeRequest(_Body):
    model: str = ""
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # prompt: True; messages: the template decides
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str = ""
    tokens: list[int]


class TokenizeRoutes:
    """``call(request, method, message, params)``: the shim's ModelService call."""

    def __init__(self, call: Any) -> None:
        self.call = call

    async def tokenize(self, request: Request, body: TokenizeRequest) -> JSONResponse:
        if (body.prompt is None) == (body.messages is None):
            raise invalid("prompt", "give exactly one of prompt and messages")
        if body.messages is not None:
            if not body.add_generation_prompt:
                raise invalid("add_generation_prompt", "only true is supported")
            if body.add_special_tokens:
                raise invalid("add_special_tokens", "not with messages (the template adds them)")
            chat = ChatCompletionRequest(model=body.model, messages=body.messages)
            message = models_pb2.TokenizeRequest(
                model=body.model, chat=chat_request(chat).requests[0].chat
            )
        else:
            message = models_pb2.TokenizeRequest(model=body.model, text=body.prompt)
            if body.add_special_tokens is not None:
                message.add_special_tokens = body.add_special_tokens
        reply = await self.call(request, "Tokenize", message, _TOKENIZE_PARAMS)
        info = await self._model_info(request, body.model)
        return JSONResponse(
            {
                "count": len(reply.token_ids),
                "max_model_len": info.max_context_tokens,
                "tokens": list(reply.token_ids),
                "token_strs": list(reply.tokens) if body.return_token_strs else None,
            }
        )

    async def detokenize(self, request: Request, body: DetokenizeRequest) -> JSONResponse:
        if any(t < 0 or t > U32_MAX for t in body.tokens):  # the proto's uint32
            raise invalid("tokens", f"token ids must be in [0, {U32_MAX}]")
        message = models_pb2.DetokenizeRequest(model=body.model, token_ids=body.tokens)
        reply = await self.call(request, "Detokenize", message, _DETOKENIZE_PARAMS)
        return JSONResponse({"prompt": reply.text})

    async def render_chat(self, request: Request, body: ChatCompletionRequest) -> JSONResponse:
        chat = chat_request(body).requests[0].chat
        message = models_pb2.TokenizeRequest(model=body.model, chat=chat)
        reply = await self.call(request, "Tokenize", message, {"chat": "messages"})
        sampling = _sampling(body)
        if body.max_completion_tokens is not None:
            sampling.setdefault("max_tokens", body.max_completion_tokens)
        return JSONResponse(_generate_request(body, list(reply.token_ids), sampling))

    async def render_completion(self, request: Request, body: CompletionRequest) -> JSONResponse:
        sampling = _sampling(body)
        out = []
        for generate in completion_requests(body).requests:
            if generate.WhichOneof("input") == "text":
                message = models_pb2.TokenizeRequest(model=body.model, text=generate.text)
                reply = await self.call(request, "Tokenize", message, {"text": "prompt"})
                ids = list(reply.token_ids)
            else:
                ids = list(generate.token_ids.ids)
            out.append(_generate_request(body, ids, sampling))
        return JSONResponse(out)

    async def _model_info(self, request: Request, model: str) -> models_pb2.ModelInfo:
        message = models_pb2.GetModelInfoRequest(model=model)
        info: models_pb2.ModelInfo = await self.call(request, "GetModelInfo", message)
        return info


def _sampling(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    dumped = body.model_dump(exclude_none=True)
    return {k: dumped[k] for k in SAMPLING_KEYS if k in dumped}


def _generate_request(
    body: ChatCompletionRequest | CompletionRequest, token_ids: list[int], sampling: dict[str, Any]
) -> dict[str, Any]:
    return {
        "request_id": uuid.uuid4().hex,
        "token_ids": token_ids,
        "features": None,
        "sampling_params": sampling,
        "model": body.model,
        "stream": bool(body.stream),
        "stream_options": None,
        "cache_salt": body.cache_salt,
        "priority": body.priority,
        "kv_transfer_params": None,
    }


def install_tokenize(app: FastAPI, call: Any) -> None:
    routes = TokenizeRoutes(call)
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
    app.add_api_route("/v1/chat/completions/render", routes.render_chat, methods=["POST"])
    app.add_api_route("/v1/completions/render", routes.render_completion, methods=["POST"])
