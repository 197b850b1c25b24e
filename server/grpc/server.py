"""Assemble the grpc.aio server: services, health, reflection, auth, limits, draining, TLS and
connection management (keepalive, connection age, message sizes, concurrent-RPC cap)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from tokenwire.runtime.engine.protocol import EngineClient
from tokenwire.server.grpc.adapters import AdapterFlags
from tokenwire.server.grpc.auth import ApiKeyInterceptor
from tokenwire.server.grpc.connection import ConnectionSettings
from tokenwire.server.grpc.convert import Limits
from tokenwire.server.grpc.embeddings import EmbeddingService
from tokenwire.server.grpc.generation import GenerationService, OutputReaders
from tokenwire.server.grpc.guard import MalformedRequestInterceptor
from tokenwire.server.grpc.models import ModelService
from tokenwire.server.grpc.reflection import enable_reflection
from tokenwire.server.grpc.session import SessionHandler
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool
from tokenwire.server.telemetry.core import Telemetry
from tokenwire.server.tenants.config import TenantConfig
from tokenwire.server.tenants.registry import TenantRegistry, merged_config
from tokenwire.server.tls.reloader import TlsReloader
from tokenwire.server.tool_parsers.detect import parser_for_template
from tokenwire.server.tool_parsers.harmony import harmony_encoding
from tokenwire.server.tool_parsers.output import check_parser_names, needs_harmony
from tokenwire.server.worker_protocol.kv_event_stream import HubKvEvents
from tokenwire.server.worker_protocol.servicer import (
    SERVICE_NAME as VLLM_ENGINE_SERVICE,
)
from tokenwire.server.worker_protocol.servicer import KvEventSource, VllmEngineServicer
from tokenwire.v1 import (
    embeddings_pb2,
    embeddings_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    models_pb2,
    models_pb2_grpc,
)

logger = logging.getLogger("tokenwire.server")

SERVICE_NAMES = (
    generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
    models_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
    embeddings_pb2.DESCRIPTOR.services_by_name["EmbeddingService"].full_name,
)


# --worker-protocol values (None: off).
WORKER_PROTOCOLS = {"vllm": VLLM_ENGINE_SERVICE}


def default_replica_id() -> str:
    """``hostname-pid``: stable for the process's life, distinct across pods (the pod name
    is the hostname) and across servers on one host."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class GrpcSettings:
    host: str = "127.0.0.1"
    port: int = 50051
    api_keys: tuple[str, ...] = ()
    # --api-key-file: tenants with models, a priority clamp and limits (merged with api_keys,
    # whose keys form the tenant "default").
    tenants: TenantConfig | None = None
    limits: Limits = field(default_factory=Limits)
    max_message_bytes: int = 16 << 20
    max_sessions: int = 256
    session_idle_timeout: float = 600.0
    # Chat output readers (--tool-call-parser, --reasoning-parser); None: off.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # LoRA adapters loaded / unloaded at runtime (ModelService.LoadAdapter, UnloadAdapter):
    # off unless --allow-runtime-lora-updating, which needs api_keys and --lora-root.
    allow_runtime_lora_updating: bool = False
    lora_root: str | None = None
    # Keepalive, connection age, message sizes, concurrent-RPC cap (server/grpc/connection.py).
    connection: ConnectionSettings = field(default_factory=ConnectionSettings)
    # --worker-protocol: a gateway worker protocol served beside tokenwire.v1 on this port
    # ("vllm": vllm.grpc.engine.VllmEngine, server/worker_protocol); None: off.
    worker_protocol: str | None = None
    # --replica-id: this process's id in a fleet (GetServerInfo, /v1/models).
    replica_id: str = field(default_factory=lambda: default_replica_id())

    def __post_init__(self) -> None:
        if self.worker_protocol is not None and self.worker_protocol not in WORKER_PROTOCOLS:
            raise ValueError(
                f"--worker-protocol must be one of {', '.join(sorted(WORKER_PROTOCOLS))}, "
                f"got {self.worker_protocol!r}"
            )
        if not self.replica_id or len(self.replica_id) > 253 or not self.replica_id.isprintable():
            raise ValueError("--replica-id must be 1-253 printable characters")
        check_parser_names(self.tool_call_parser, self.reasoning_parser)
        merged = merged_config(self.api_keys, self.tenants)  # --api-key with the key file
        # Runtime LoRA updating needs authenticated callers: keys of either flag.
        self.adapter_flags.check(tuple(t.name for t in merged.tenants))

    @property
    def adapter_flags(self) -> AdapterFlags:
        return AdapterFlags(self.allow_runtime_lora_updating, self.lora_root)


class GrpcServer:
    """Starts NOT_SERVING; ``set_serving(True)`` once the engine is warm. With ``tls`` the
    port serves TLS only (mTLS with ``--ssl-cert-reqs required``), certificates reloadable."""

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        settings: GrpcSettings,
        telemetry: Telemetry | None = None,
        tls: TlsReloader | None = None,
        tenants: TenantRegistry | None = None,
        kv_events: KvEventSource | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.tls = tls
        self.telemetry = _attached_telemetry(engine, telemetry)
        # Key -> tenant, limits and accounting; ``tenants.reload()`` re-reads the key file.
        self.tenants = tenants or TenantRegistry(settings.tenants, settings.api_keys)
        # Every handler checks its responses against the send limit before grpc-core does.
        send_limit = settings.connection.send_bytes(settings.max_message_bytes)
        limits = dataclasses.replace(settings.limits, max_response_bytes=send_limit)
        self.server = self._aio_server(send_limit)
        self.tool_call_parser = _tool_call_parser(engine, settings)
        self.tokenizers = _tokenizer_pool(engine, settings)
        _watch_processed_images(self.telemetry, self.tokenizers)
        self.serving = False  # what health says: warm and not draining
        self.sessions = self._add_services(engine, model_name, limits)
        self.service_names: tuple[str, ...] = SERVICE_NAMES
        if settings.worker_protocol == "vllm":  # the gateway worker protocol, same port
            self._add_worker_protocol(engine, model_name, limits, kv_events)
        embeddings_pb2_grpc.add_EmbeddingServiceServicer_to_server(
            EmbeddingService(
                engine, model_name, limits, self.tokenizers, self.telemetry, self.tenants
            ),
            self.server,
        )
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # Reflection: v1 and v1alpha.
        enable_reflection((*self.service_names, "grpc.health.v1.Health"), self.server)
        self.port = 0
        engine.on_dead(self._engine_died)

    def _aio_server(self, send_limit: int) -> grpc.aio.Server:
        """The grpc.aio server with its interceptors, channel options and concurrent-RPC cap."""
        # The OTel interceptor runs first, so even a call refused by auth gets its RPC span.
        interceptors = list(self.telemetry.grpc_interceptors())
        if self.tenants.auth_required:  # before the decode guard: no key, no parsing
            interceptors.append(ApiKeyInterceptor(self.tenants))
        interceptors.append(MalformedRequestInterceptor(send_limit))
        connection = self.settings.connection
        return grpc.aio.server(
            interceptors=interceptors,
            options=connection.server_options(self.settings.max_message_bytes),
            maximum_concurrent_rpcs=connection.max_concurrent_rpcs,
        )

    def _add_services(
        self, engine: EngineClient, model_name: str, limits: Limits
    ) -> SessionHandler:
        """The Session handler, GenerationService (which owns its streams) and ModelService."""
        settings = self.settings
        sessions = SessionHandler(
            engine,
            model_name,
            limits,
            self.tokenizers,
            settings.max_sessions,
            settings.session_idle_timeout,
            self.telemetry,
            self.tenants,
        )
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(
            GenerationService(
                engine,
                model_name,
                limits,
                self.tokenizers,
                sessions,
                self.telemetry,
                OutputReaders(self.tool_call_parser, settings.reasoning_parser),
                self.tenants,
            ),
            self.server,
        )
        models_pb2_grpc.add_ModelServiceServicer_to_server(
            ModelService(
                engine,
                model_name,
                limits,
                self.tokenizers,
                settings.max_sessions,
                self.tenants.auth_required,
                settings.adapter_flags,
                self.tenants,
                settings.replica_id,
            ),
            self.server,
        )
        return sessions

    def _add_worker_protocol(
        self,
        engine: EngineClient,
        model_name: str,
        limits: Limits,
        kv_events: KvEventSource | None,
    ) -> None:
        """--worker-protocol vllm: vLLM's engine service beside tokenwire.v1, on this port."""
        hub = engine.kv_events  # None unless --kv-events-config
        if kv_events is None and hub is not None:
            kv_events = HubKvEvents(engine, hub)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
            VllmEngineServicer(
                engine,
                model_name,
                limits,
                self.tokenizers,
                self.telemetry,
                self.tenants,
                lambda: self.serving,
                kv_events,
            ),
            self.server,
        )
        self.service_names = (*SERVICE_NAMES, VLLM_ENGINE_SERVICE)

    def _engine_died(self) -> None:
        # A dead engine must drop out of load balancing: health goes NOT_SERVING for good.
        asyncio.get_running_loop().create_task(self.set_serving(False))

    async def start(self) -> int:
        """Bind and start; returns the bound port (useful with port 0)."""
        address = f"{self.settings.host}:{self.settings.port}"
        if self.tls is not None:
            self.port = self.server.add_secure_port(address, self.tls.grpc_credentials())
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise ValueError(
                f"cannot bind {self.settings.host}:{self.settings.port}: choose another --grpc-port"
            )
        await self.set_serving(False)
        await self.server.start()
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.serving = serving
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def drain(self, timeout: float) -> None:
        """NOT_SERVING, refuse new calls (UNAVAILABLE), finish in-flight ones up to timeout."""
        await self.set_serving(False)
        self.sessions.notify_draining()
        await self.engine.drain(timeout)

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        if self.tokenizers is not None:
            self.tokenizers.shutdown()


def _attached_telemetry(engine: EngineClient, telemetry: Telemetry | None) -> Telemetry:
    """The given telemetry (request logs only when None), its metrics attached to the engine."""
    if telemetry is None:  # request logs only: no metrics wiring, no tracing
        telemetry = Telemetry()
    if telemetry.metrics is None:
        telemetry.attach(engine)
    return telemetry


def _tool_call_parser(engine: EngineClient, settings: GrpcSettings) -> str | None:
    """--tool-call-parser, else the one the chat template implies (None: unknown, and
    tool_choice "auto" is refused naming the flag). Loads the harmony encoding when a reader
    needs it: once, here, not on the first request's event loop."""
    parser = settings.tool_call_parser
    tokenizer = engine.frontend.tokenizer
    if parser is None and tokenizer is not None:
        parser = parser_for_template(tokenizer.chat_template)
    if needs_harmony(parser, settings.reasoning_parser):
        harmony_encoding()
    return parser


def _watch_processed_images(telemetry: Telemetry, pool: TokenizerPool | None) -> None:
    """The pool's processed-image cache hits and misses as metrics (when it keeps any)."""
    if pool is not None and telemetry.metrics is not None and pool.processed_images.enabled:
        telemetry.metrics.watch_processed_images(pool.processed_images.stats)


def _tokenizer_pool(engine: EngineClient, settings: GrpcSettings) -> TokenizerPool | None:
    """The request tokenizers (None: the model has no tokenizer)."""
    frontend = engine.frontend
    if frontend.tokenizer is None:
        return None
    max_prompt_bytes = settings.limits.prompt_bytes(engine.info.max_model_len)
    return TokenizerPool(frontend, max_prompt_bytes, images=settings.limits.images)
