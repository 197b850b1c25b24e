"""asyncio tokenwire client (grpc.aio): the same surface as ``Client``, as coroutines.

async with AsyncClient("127.0.0.1:50051") as client:
    print((await client.generate("Hello", max_tokens=16)).text)
    async for event in client.stream("Hello"):
        ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar, Unpack

import grpc

from tokenwire.clients import convert
from tokenwire.clients import results as r
from tokenwire.clients.async_session import AsyncSession
from tokenwire.clients.channel import (
    DEFAULT_RETRY_POLICY,
    RetryPolicy,
    TlsOptions,
    channel_options,
    open_aio_channel,
)
from tokenwire.clients.client import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TARGET
from tokenwire.clients.content import Messages
from tokenwire.clients.convert import GenerationOptions
from tokenwire.clients.errors import from_rpc_error
from tokenwire.v1 import generation_pb2 as gen
from tokenwire.v1 import generation_pb2_grpc as gen_grpc
from tokenwire.v1 import models_pb2 as mpb
from tokenwire.v1 import models_pb2_grpc as models_grpc

T = TypeVar("T")


class AsyncClient:
    """Non-blocking client over one grpc.aio channel. Every ``grpc.RpcError``
    becomes a ``TokenwireError`` subclass. ``timeout`` is the default deadline (seconds) of
    each call except sessions; ``None`` means no deadline. ``tls``, ``retry`` and
    ``load_balancing`` as ``Client``'s (TLS off, the default retry policy on)."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls: TlsOptions | None = None,
        retry: RetryPolicy | None = DEFAULT_RETRY_POLICY,
        load_balancing: str | None = None,
    ) -> None:
        self.target = target
        self._api_key = api_key
        self._timeout = timeout
        options = channel_options(max_message_bytes, retry, tls, load_balancing)
        self._channel = open_aio_channel(target, options, tls)
        self._generation = gen_grpc.GenerationServiceStub(self._channel)
        self._models = models_grpc.ModelServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self,
        method: Callable[..., Awaitable[T]],
        request: Any,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
        priority: int | None = None,
        session_key: str | None = None,
    ) -> T:
        metadata = convert.call_metadata(self._api_key, request_id, priority, session_key)
        deadline = self._timeout if timeout is None else timeout
        try:
            return await method(request, metadata=metadata, timeout=deadline)
        except grpc.RpcError as err:
            raise from_rpc_error(err, request_id) from err

    # ------------------------------------------------------------------------ generation

    async def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Messages | None = None,
        model: str = "",
        request_id: str | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,
        priority: int | None = None,
        session_key: str | None = None,
        **options: Unpack[GenerationOptions],
    ) -> r.Completion:
        """Generate a complete answer for text, token ids or chat ``messages``.
        ``session_key``: the conversation's affinity key, sent as ``x-session-id``."""
        request = convert.generate_request(
            prompt, messages, model=model, request_id=request_id, cache_salt=cache_salt,
            options=options,
        )  # fmt: skip
        response: gen.GenerateResponse = await self._call(
            self._generation.Generate, request, timeout=timeout, request_id=request_id,
            priority=priority, session_key=session_key,
        )  # fmt: skip
        return convert.completion(response)

    def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Messages | None = None,
        model: str = "",
        request_id: str | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,
        priority: int | None = None,
        session_key: str | None = None,
        **options: Unpack[GenerationOptions],
    ) -> AsyncIterator[r.StreamEvent]:
        """Stream events: StreamStart, TextDelta*, one ChoiceEnd per choice, StreamUsage.

        The call starts now (inside a running loop); ``aclose()`` on the iterator, leaving an
        ``async for`` early, or cancelling the consuming task cancels it on the server.
        """
        request = convert.generate_request(
            prompt, messages, model=model, request_id=request_id, cache_salt=cache_salt,
            options=options,
        )  # fmt: skip
        metadata = convert.call_metadata(self._api_key, request_id, priority, session_key)
        deadline = self._timeout if timeout is None else timeout
        call = self._generation.GenerateStream(request, metadata=metadata, timeout=deadline)
        return _stream_events(call, request_id)

    async def cancel(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Cancel one of this caller's in-flight requests; False if none was running."""
        request = gen.CancelRequest(request_id=request_id)
        response: gen.CancelResponse = await self._call(
            self._generation.Cancel, request, timeout=timeout
        )
        return bool(response.cancelled)

    def session(
        self,
        model: str = "",
        system_prompt: str | None = None,
        *,
        cache_salt: str | None = None,
        timeout: float | None = None,
        session_key: str | None = None,
        reconnect: bool = True,
        **options: Unpack[GenerationOptions],
    ) -> AsyncSession:
        """A Session to use as ``async with client.session(...) as s`` (or ``await s.open()``
        and ``await s.close()``). ``options`` are defaults for every turn. ``session_key``:
        its ``x-session-id`` (default: a random one per session); ``reconnect``: reopen the
        conversation with its transcript when its replica is lost (``AsyncSession``)."""
        opening = convert.session_open(model, system_prompt, cache_salt, options)
        metadata = convert.call_metadata(self._api_key)
        return AsyncSession(
            self._generation.Session, opening, metadata, options.get("n") or 1, timeout,
            session_key, reconnect,
        )  # fmt: skip

    # ----------------------------------------------------------------------------- models

    async def models(self, *, timeout: float | None = None) -> list[mpb.ModelInfo]:
        response: mpb.ListModelsResponse = await self._call(
            self._models.ListModels, mpb.ListModelsRequest(), timeout=timeout
        )
        return list(response.models)

    async def model_info(self, model: str = "", *, timeout: float | None = None) -> mpb.ModelInfo:
        request = mpb.GetModelInfoRequest(model=model)
        info: mpb.ModelInfo = await self._call(self._models.GetModelInfo, request, timeout=timeout)
        return info

    async def server_info(self, *, timeout: float | None = None) -> mpb.ServerInfo:
        request = mpb.GetServerInfoRequest()
        info: mpb.ServerInfo = await self._call(
            self._models.GetServerInfo, request, timeout=timeout
        )
        return info

    async def tokenize(
        self,
        text: str,
        add_special_tokens: bool = True,
        *,
        model: str = "",
        timeout: float | None = None,
    ) -> list[int]:
        request = mpb.TokenizeRequest(model=model, text=text, add_special_tokens=add_special_tokens)
        response: mpb.TokenizeResponse = await self._call(
            self._models.Tokenize, request, timeout=timeout
        )
        return [int(t) for t in response.token_ids]

    async def detokenize(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = True,
        *,
        model: str = "",
        timeout: float | None = None,
    ) -> str:
        request = mpb.DetokenizeRequest(
            model=model, token_ids=list(ids), skip_special_tokens=skip_special_tokens
        )
        response: mpb.DetokenizeResponse = await self._call(
            self._models.Detokenize, request, timeout=timeout
        )
        return str(response.text)


async def _stream_events(call: Any, request_id: str | None) -> AsyncIterator[r.StreamEvent]:
    """Convert a GenerateStream call's messages; cancel the call however iteration ends."""
    try:
        async for response in call:
            event = convert.stream_event(response)
            if event is not None:
                yield event
    except grpc.RpcError as err:
        raise from_rpc_error(err, request_id) from err
    finally:
        call.cancel()
