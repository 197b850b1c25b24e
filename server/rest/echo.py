"""Completions' ``echo``: the prompt before each choice, in its text and in its logprobs.

``echo: true`` puts each prompt's text before its choices' text (a token-id prompt is
detokenized upstream). With ``logprobs: k`` the choice's ``logprobs`` start with the prompt's
tokens too, as OpenAI's legacy completions and vLLM give them (what evaluation harnesses read
a continuation's log-likelihood from): the first prompt token with ``null`` logprob and
``null`` top, then each later prompt token with its logprob under the model and its top
``k`` (the gRPC ``prompt_logprobs``, asked for with ``k`` alternatives), then the generated
tokens; ``text_offset`` counts on through the prompt's tokens. The first token's text is
what the model service's ``Tokenize`` and ``Detokenize`` give for it (decoded on its own, as
every logprob token is). ``max_tokens: 0`` with ``echo`` (vLLM's "echo without
generation") sends ``max_tokens: 1`` upstream and shows the prompt alone: its text, its
logprobs, finish reason ``length`` and no completion tokens in ``usage``. A stream with
``echo`` and ``logprobs`` (the prompt's logprobs arrive at its end) or with ``max_tokens: 0``
is a 400 naming ``echo``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from tokenwire.server.rest.errors import from_rpc_error
from tokenwire.server.rest.responses import Echo
from tokenwire.server.rest.upstream import CallOptions, Upstream
from tokenwire.v1 import generation_pb2, models_pb2

_NAMES = {"token_ids": "prompt", "text": "prompt", "model": "model"}


@dataclass(frozen=True)
class EchoSpec:
    """What a completions request asked to echo (``requests.completion_requests``)."""

    prompts: tuple[str | list[int], ...]
    top: int | None = None  # ``logprobs``: the prompt's tokens' logprobs too, with this top
    only: bool = False  # ``max_tokens: 0``: the prompt alone, nothing generated shown


async def resolve_echo(
    spec: EchoSpec | None,
    requests: Sequence[generation_pb2.GenerateRequest],
    upstream: Upstream,
    options: CallOptions,
) -> Echo | None:
    """The echo of each prompt, asking the model service what a client sent as ids (their
    text) or as text (its first token, with logprobs)."""
    if spec is None:
        return None
    texts, firsts = [], []
    for prompt, message in zip(spec.prompts, requests, strict=True):
        ids = prompt if isinstance(prompt, list) else None
        if isinstance(prompt, str):
            texts.append(prompt)
        else:
            texts.append(await _decode(upstream, message.model, prompt, options))
        if spec.top is None:
            continue
        if ids is None:
            ids = await _encode(upstream, message.model, str(prompt), options)
        firsts.append(await _decode(upstream, message.model, ids[:1], options) if ids else "")
    first = tuple(firsts) if spec.top is not None else None
    return Echo(tuple(texts), first, spec.top, spec.only)


async def _decode(upstream: Upstream, model: str, ids: list[int], options: CallOptions) -> str:
    request = models_pb2.DetokenizeRequest(model=model, token_ids=ids, skip_special_tokens=False)
    try:
        reply = await upstream.models.Detokenize(
            request, metadata=options.metadata, timeout=options.timeout
        )
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err, _NAMES) from None
    return str(reply.text)


async def _encode(upstream: Upstream, model: str, text: str, options: CallOptions) -> list[int]:
    request = models_pb2.TokenizeRequest(model=model, text=text)
    try:
        reply = await upstream.models.Tokenize(
            request, metadata=options.metadata, timeout=options.timeout
        )
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err, _NAMES) from None
    return list(reply.token_ids)
