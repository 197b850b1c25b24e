"""The REST shim's side of the gRPC API: one shared grpc.aio channel and its stubs.

Forwards the caller's ``authorization``, ``x-request-id``, ``x-priority`` and W3C
``traceparent``/``tracestate`` headers as gRPC metadata (the gRPC server decides on auth).
Fan-out helpers run one gRPC call per prompt and cancel every sibling as soon as one fails,
and every call that is abandoned (error, cancelled task, client gone) is cancelled, so the
engine frees its blocks.

The channel is plaintext, or TLS when the gRPC server serves TLS (``connect(credentials=)``;
``tokenwire serve`` passes the loopback credentials of ``TlsReloader``). ``reconnect`` swaps
in a new channel after a certificate reload: new calls use it, calls already running finish
on the old one, which is closed with this ``Upstream``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenwire.server.rest.errors import invalid
from tokenwire.v1 import (
    embeddings_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    models_pb2_grpc,
)

# x-session-id: the affinity key a gateway's consistent hashing reads (docs/fleet.md).
FORWARDED_HEADERS = ("authorization", "traceparent", "tracestate", "x-priority", "x-session-id")
StreamCall: TypeAlias = grpc.aio.UnaryStreamCall  # grpc ships no type stubs
Event = generation_pb2.GenerateStreamResponse


@dataclass(frozen=True)
class CallOptions:
    """Per HTTP request: the gRPC metadata to send and the deadline (seconds)."""

    request_id: str
    metadata: tuple[tuple[str, str], ...]
    timeout: float | None

    def for_prompt(self, index: int, count: int) -> CallOptions:
        """Fanned-out calls need distinct ids: ``<id>-<index>`` when there are several."""
        if count == 1:
            return self
        rid = f"{self.request_id}-{index}"
        rest = tuple(kv for kv in self.metadata if kv[0] != "x-request-id")
        return CallOptions(rid, (*rest, ("x-request-id", rid)), self.timeout)


def call_options(
    headers: Mapping[str, str], request_id: str, timeout: float | None, priority: int | None = None
) -> CallOptions:
    """``priority``: the body's (vLLM's field), sent as ``x-priority`` unless the header is."""
    metadata = [("x-request-id", request_id)]
    if priority is not None and headers.get("x-priority") is None:
        metadata.append(("x-priority", str(priority)))
    for name in FORWARDED_HEADERS:
        value = headers.get(name)
        if value is None:
            continue
        if not value.isascii() or not value.isprintable():
            raise invalid(name, f"header {name} must be printable ASCII", "invalid_header")
        metadata.append((name, value))
    return CallOptions(request_id, tuple(metadata), timeout)


class Upstream:
    """Stubs over one channel; ``close`` closes the channel when this object owns it."""

    def __init__(self, channel: grpc.aio.Channel, owns_channel: bool = False) -> None:
        self.owns_channel = owns_channel
        self._retired: list[grpc.aio.Channel] = []
        self._use(channel)

    def _use(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.generation = generation_pb2_grpc.GenerationServiceStub(channel)
        self.models = models_pb2_grpc.ModelServiceStub(channel)
        self.embeddings = embeddings_pb2_grpc.EmbeddingServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    @classmethod
    def connect(
        cls,
        target: str,
        max_message_bytes: int = 16 << 20,
        credentials: grpc.ChannelCredentials | None = None,
        tls_name: str | None = None,
    ) -> Upstream:
        """A channel of its own to ``target``: TLS with ``credentials`` (``tls_name``: the
        name checked against the server certificate when it is not the target's host)."""
        return cls(open_channel(target, max_message_bytes, credentials, tls_name), True)

    def reconnect(self, channel: grpc.aio.Channel) -> None:
        """New calls go over ``channel``; running ones finish on the old one."""
        self._retired.append(self.channel)
        self._use(channel)

    async def close(self) -> None:
        if self.owns_channel:
            for channel in (*self._retired, self.channel):
                await channel.close()

    async def serving(self, timeout: float = 5.0) -> bool:
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    # ------------------------------------------------------------------ generation
    async def generate_all(
        self, requests: Sequence[generation_pb2.GenerateRequest], options: CallOptions
    ) -> list[generation_pb2.GenerateResponse]:
        """Unary Generate per request, concurrently; the first failure cancels the rest."""
        count = len(requests)
        tasks = [
            asyncio.ensure_future(self._generate(r, options.for_prompt(i, count)))
            for i, r in enumerate(requests)
        ]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _generate(
        self, request: generation_pb2.GenerateRequest, options: CallOptions
    ) -> generation_pb2.GenerateResponse:
        call = self.generation.Generate(request, metadata=options.metadata, timeout=options.timeout)
        try:
            response: generation_pb2.GenerateResponse = await call
            return response
        finally:
            call.cancel()  # a no-op once finished; frees the engine's blocks otherwise

    async def open_streams(
        self, requests: Sequence[generation_pb2.GenerateRequest], options: CallOptions
    ) -> OpenStreams:
        """Start every stream and read its first event, so request errors (bad parameter,
        unknown model, full queue, ...) surface before the HTTP response starts."""
        count = len(requests)
        calls: list[StreamCall] = [
            self.generation.GenerateStream(r, metadata=o.metadata, timeout=o.timeout)
            for i, r in enumerate(requests)
            for o in (options.for_prompt(i, count),)
        ]
        streams = OpenStreams(calls)
        try:
            firsts = await asyncio.gather(*(call.read() for call in calls), return_exceptions=True)
        except BaseException:  # this task was cancelled (e.g. the client went away)
            streams.cancel()
            raise
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            streams.cancel()
            raise errors[0]
        streams.firsts = list(firsts)
        return streams


def open_channel(
    target: str,
    max_message_bytes: int = 16 << 20,
    credentials: grpc.ChannelCredentials | None = None,
    tls_name: str | None = None,
) -> grpc.aio.Channel:
    options: list[tuple[str, int | str]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    if tls_name is not None:
        options.append(("grpc.ssl_target_name_override", tls_name))
    return grpc.aio.secure_channel(target, credentials, options=options)


class OpenStreams:
    """Started GenerateStream calls whose first events were read (one per prompt)."""

    def __init__(self, calls: list[StreamCall]) -> None:
        self.calls = calls
        self.firsts: list[Event | object] = []

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """``(prompt index, event)`` of every stream, interleaved as they arrive."""
        try:
            if len(self.calls) == 1:
                async for event in _read_all(self.calls[0], self.firsts[0]):
                    yield 0, event
            else:
                async for item in _merge(self.calls, self.firsts):
                    yield item
        finally:
            self.cancel()


async def _read_all(call: StreamCall, first: Event | object) -> AsyncIterator[Event]:
    event = first
    while event is not grpc.aio.EOF:
        yield event  # type: ignore[misc]
        event = await call.read()


async def _merge(
    calls: list[StreamCall], firsts: list[Event | object]
) -> AsyncIterator[tuple[int, Event]]:
    queue: asyncio.Queue[tuple[int, Event] | BaseException | None] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for event in _read_all(calls[index], firsts[index]):
                queue.put_nowait((index, event))
            queue.put_nowait(None)
        except Exception as exc:
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(calls))]
    try:
        remaining = len(calls)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
