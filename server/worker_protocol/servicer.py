"""The ``vllm.grpc.engine.VllmEngine`` servicer: tokenwire as a worker of gateways that speak
vLLM's engine protocol (SMG routes to it with ``grpc://`` worker URLs).

It runs on tokenwire's own grpc.aio server (``--worker-protocol vllm``): same port, same API
keys and tenants, TLS, malformed-request guard, health and drain. ``SubscribeKvEvents``
streams from an optional ``kv_events`` source given at construction; without one it is
UNIMPLEMENTED naming the flag that turns KV events on.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from tokenwire.runtime.engine.protocol import EngineClient
from tokenwire.server.grpc.call_context import caller_of, internal_request_id
from tokenwire.server.grpc.convert import Limits
from tokenwire.server.grpc.errors import ServiceError, abort, to_service_error
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool
from tokenwire.server.telemetry.core import Telemetry
from tokenwire.server.tenants.registry import TenantRegistry
from tokenwire.server.worker_protocol.embed import WorkerEmbed
from tokenwire.server.worker_protocol.generate import WorkerGenerate
from tokenwire.server.worker_protocol.info import model_info, server_info
from tokenwire.server.worker_protocol.loads import loads
from tokenwire.server.worker_protocol.tokenizer_bundle import TokenizerBundle, build_bundle
from tokenwire.v1 import errors_pb2

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
KV_EVENTS_OFF = "KV events are off: start with --kv-events-config"


class KvEventSource(Protocol):
    """What ``SubscribeKvEvents`` streams from (built beside the KV cache manager)."""

    def subscribe(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]: ...


def unimplemented(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNIMPLEMENTED, errors_pb2.ERROR_REASON_UNSPECIFIED, message)


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        limits: Limits,
        tokenizers: TokenizerPool | None,
        telemetry: Telemetry,
        tenants: TenantRegistry,
        serving: Callable[[], bool],
        kv_events: KvEventSource | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizers = tokenizers
        self.tenants = tenants
        self.serving = serving  # the server's health: False before warm-up and once draining
        self.kv_events = kv_events
        self.started_at = time.monotonic()
        self.generate = WorkerGenerate(engine, model_name, limits, tokenizers, telemetry, tenants)
        self.embed = WorkerEmbed(engine, model_name, telemetry, tenants)
        self._bundle: TokenizerBundle | None = None

    async def Generate(
        self, request: vllm_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]:
        # grpc.aio picks streaming handling by inspecting for an async generator function.
        async for message in self.generate(request, context):
            yield message

    async def Abort(
        self, request: vllm_engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.AbortResponse:
        """Abort the caller's own requests by id (unknown or finished ids: nothing)."""
        try:
            caller = caller_of(context, self.tenants)
        except Exception as exc:
            await abort(context, to_service_error(exc))
        for request_id in request.request_ids:
            self.engine.abort(internal_request_id(caller, request_id))
        return vllm_engine_pb2.AbortResponse()

    async def HealthCheck(
        self, request: vllm_engine_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.HealthCheckResponse:
        if self.engine.is_dead:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="engine is dead")
        if not self.serving():
            return vllm_engine_pb2.HealthCheckResponse(
                healthy=False, message="not serving (warming up or draining)"
            )
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(
        self, request: vllm_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetModelInfoResponse:
        return model_info(self.engine, self.model_name)

    async def GetServerInfo(
        self, request: vllm_engine_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetServerInfoResponse:
        uptime = time.monotonic() - self.started_at
        return server_info(self.engine, uptime, self.serving())

    async def GetLoads(
        self, request: vllm_engine_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetLoadsResponse:
        return loads(self.engine, request.dp_rank if request.HasField("dp_rank") else None)

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        if self.tokenizers is None:
            await abort(
                context,
                ServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    errors_pb2.ERROR_REASON_UNSPECIFIED,
                    "this model has no tokenizer (token ids only)",
                ),
            )
        if self._bundle is None:  # built once, on the tokenizer pool (off the event loop)
            pool = self.tokenizers
            tokenizer = pool.tokenizer
            self._bundle = await pool.run(build_bundle, tokenizer, self.engine.info.tokenizer_path)
        for chunk in self._bundle.chunks():
            yield chunk

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        if await self.engine.reset_prefix_cache():
            return common_pb2.FlushCacheResponse(success=True, message="prefix cache reset")
        return common_pb2.FlushCacheResponse(
            success=False,
            message="prefix cache not reset: requests or sessions hold KV blocks; retry when idle",
        )

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        if self.kv_events is None:
            await abort(context, unimplemented(KV_EVENTS_OFF))
        assert self.kv_events is not None
        async for batch in self.kv_events.subscribe(request, context):
            yield batch

    async def Embed(
        self, request: vllm_engine_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.EmbedResponse:
        return await self.embed(request, context)

    async def StartProfile(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(context, unimplemented("StartProfile is not implemented by tokenwire's worker"))

    async def StopProfile(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(context, unimplemented("StopProfile is not implemented by tokenwire's worker"))
