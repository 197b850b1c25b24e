"""Synchronous tokenwire client: typed results, typed exceptions, deadlines, sessions.

with Client("127.0.0.1:50051", api_key="...") as client:
    print(client.generate("Hello", max_tokens=16).text)
    for event in client.stream(messages=[{"role": "user", "content": "Hi"}]):
        ...
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, Unpack

import grpc

from tokenwire.clients import convert
from tokenwire.clients import results as r
from tokenwire.clients.channel import (
    DEFAULT_RETRY_POLICY,
    RetryPolicy,
    TlsOptions,
    channel_options,
    open_channel,
)
from tokenwire.clients.content import Messages
from tokenwire.clients.convert import GenerationOptions
from tokenwire.clients.errors import from_rpc_error
from tokenwire.clients.sync_session import SyncSession
from tokenwire.v1 import generation_pb2 as gen
from tokenwire.v1 import generation_pb2_grpc as gen_grpc
from tokenwire.v1 import models_pb2 as mpb
from tokenwire.v1 import models_pb2_grpc as models_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

T = TypeVar("T")


class Client:
    """Blocking client over one channel. Every ``grpc.RpcError`` becomes a
    ``TokenwireError`` subclass. ``timeout`` is the default deadline (seconds) of each call
    except sessions; ``None`` means no deadline. ``tls``: connect over TLS (root CA, client
    certificate for mTLS); plaintext without it. ``retry``: the gRPC retry policy for
    UNAVAILABLE / RESOURCE_EXHAUSTED (``clients/channel.py``); ``None`` turns retries off.
    ``load_balancing``: ``"round_robin"`` spreads calls over every address ``target`` resolves
    to (a Kubernetes headless Service, or ``ipv4:HOST:PORT,HOST:PORT``)."""

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
        self._channel = open_channel(target, options, tls)
        self._generation = gen_grpc.GenerationServiceStub(self._channel)
        self._models = models_grpc.ModelServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        method: Callable[..., T],
        request: Any,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
        priority: int | None = None,
    ) -> T:
        metadata = convert.call_metadata(self._api_key, request_id, priority)
        deadline = self._timeout if timeout is None else timeout
        try:
            return method(request, metadata=metadata, timeout=deadline)
        except grpc.RpcError as err:
            raise from_rpc_error(err, request_id) from err

    # ------------------------------------------------------------------------ generation

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Messages | None = None,
        model: str = "",
        request_id: str | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,
        priority: int | None = None,
        **options: Unpack[GenerationOptions],
    ) -> r.Completion:
        """Generate a complete answer for text, token ids or chat ``messages``."""
        request = convert.generate_request(
            prompt, messages, model=model, request_id=request_id, cache_salt=cache_salt,
            options=options,
        )  # fmt: skip
        response: gen.GenerateResponse = self._call(
            self._generation.Generate, request, timeout=timeout, request_id=request_id,
            priority=priority,
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
        **options: Unpack[GenerationOptions],
    ) -> Iterator[r.StreamEvent]:
        """Stream events: StreamStart, TextDelta*, one ChoiceEnd per choice, StreamUsage.

        The call starts now; closing the iterator (or breaking out of a for loop over it)
        cancels it on the server.
        """
        request = convert.generate_request(
            prompt, messages, model=model, request_id=request_id, cache_salt=cache_salt,
            options=options,
        )  # fmt: skip
        metadata = convert.call_metadata(self._api_key, request_id, priority)
        deadline = self._timeout if timeout is None else timeout
        call = self._generation.GenerateStream(request, metadata=metadata, timeout=deadline)
        return _stream_events(call, request_id)

    def cancel(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Cancel one of this caller's in-flight requests; False if none was running."""
        request = gen.CancelRequest(request_id=request_id)
        response: gen.CancelResponse = self._call(self._generation.Cancel, request, timeout=timeout)
        return bool(response.cancelled)

    def session(
        self,
        model: str = "",
        system_prompt: str | None = None,
        *,
        cache_salt: str | None = None,
        timeout: float | None = None,
        session_key: str | None = None,
        **options: Unpack[GenerationOptions],
    ) -> SyncSession:
        """Open a Session (a conversation whose KV cache stays on the server).

        ``options`` are defaults for every turn. ``timeout`` bounds the whole session
        (default: none). Use as a context manager so the session is closed. The stream
        carries ``x-session-id: session_key`` (default: a random key per session) for a
        gateway's affinity; reopening a lost session is ``AsyncSession``'s (not this one's).
        """
        opening = convert.session_open(model, system_prompt, cache_salt, options)
        key = session_key or uuid.uuid4().hex
        metadata = convert.call_metadata(self._api_key, session_key=key)
        return SyncSession(
            self._generation.Session, opening, metadata, options.get("n") or 1, timeout
        )

    # ----------------------------------------------------------------------------- models

    def models(self, *, timeout: float | None = None) -> list[mpb.ModelInfo]:
        response: mpb.ListModelsResponse = self._call(
            self._models.ListModels, mpb.ListModelsRequest(), timeout=timeout
        )
        return list(response.models)

    def model_info(self, model: str = "", *, timeout: float | None = None) -> mpb.ModelInfo:
        request = mpb.GetModelInfoRequest(model=model)
        info: mpb.ModelInfo = self._call(self._models.GetModelInfo, request, timeout=timeout)
        return info

    def server_info(self, *, timeout: float | None = None) -> mpb.ServerInfo:
        request = mpb.GetServerInfoRequest()
        info: mpb.ServerInfo = self._call(self._models.GetServerInfo, request, timeout=timeout)
        return info

    def tokenize(
        self,
        text: str,
        add_special_tokens: bool = True,
        *,
        model: str = "",
        timeout: float | None = None,
    ) -> list[int]:
        request = mpb.TokenizeRequest(model=model, text=text, add_special_tokens=add_special_tokens)
        response: mpb.TokenizeResponse = self._call(self._models.Tokenize, request, timeout=timeout)
        return [int(t) for t in response.token_ids]

    def detokenize(
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
        response: mpb.DetokenizeResponse = self._call(
            self._models.Detokenize, request, timeout=timeout
        )
        return str(response.text)


def _stream_events(call: Any, request_id: str | None) -> Iterator[r.StreamEvent]:
    """Convert a GenerateStream call's messages; cancel the call however iteration ends."""
    try:
        for response in call:
            event = convert.stream_event(response)
            if event is not None:
                yield event
    except grpc.RpcError as err:
        raise from_rpc_error(err, request_id) from err
    finally:
        call.cancel()
