"""A real tokenwire gRPC server on 127.0.0.1:<ephemeral> in a background thread.

The server (grpc.aio + AsyncEngine) runs on its own event loop thread, and its engine core in
a process of its own (as ``tokenwire serve`` runs it) or, with ``in_process=True``, on a
thread. Tests talk to it through generated stubs like any client. ``assert_idle`` waits for
every stream to end (an event, not a sleep) and then asks the core whether it is idle with
every KV block free.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import grpc
from tiny_models import TEST_KV_CACHE_BYTES

from tokenwire.runtime.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from tokenwire.runtime.engine.async_engine import AsyncEngine
from tokenwire.runtime.engine.core import EngineCore
from tokenwire.runtime.engine.inproc_client import InprocCoreClient
from tokenwire.runtime.engine.protocol import IdleReport
from tokenwire.runtime.kv_events_config import KVEventsConfig
from tokenwire.runtime.stats import EngineObserver
from tokenwire.server.grpc.connection import ConnectionSettings
from tokenwire.server.grpc.convert import Limits
from tokenwire.server.grpc.server import GrpcServer, GrpcSettings
from tokenwire.server.tls.reloader import TlsReloader

T = TypeVar("T")
MODEL_NAME = "tiny"


class ServerHarness:
    def __init__(
        self,
        model_dir: Path | None,
        *,
        api_keys: tuple[str, ...] = (),
        observer: EngineObserver | None = None,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 256,
        num_blocks: int | None = None,
        max_model_len: int | None = 256,
        max_requests: int = 64,
        session_idle_timeout: float = 600.0,
        max_sessions: int = 8,
        limits: Limits | None = None,
        warm: bool = True,
        in_process: bool = False,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        lora: LoRAConfig | None = None,
        allow_runtime_lora_updating: bool = False,
        lora_root: str | None = None,
        tls: TlsReloader | None = None,  # serve TLS (mTLS) instead of plaintext
        connection: ConnectionSettings | None = None,
        worker_protocol: str | None = None,  # "vllm": also serve vllm.grpc.engine.VllmEngine
        kv_events: KVEventsConfig | None = None,  # --kv-events-config
        async_scheduling: bool = False,
        kv_offloading_size: float | None = None,  # --kv-offloading-size (GiB)
    ) -> None:
        self.config = EngineConfig(
            model=ModelConfig(
                model=None if model_dir is None else str(model_dir),
                max_model_len=max_model_len,
                served_model_name=MODEL_NAME,
            ),
            cache=CacheConfig(
                num_gpu_blocks_override=num_blocks,
                kv_cache_memory=TEST_KV_CACHE_BYTES,
                kv_offloading_size=kv_offloading_size,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                async_scheduling=async_scheduling,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size
            ),
            lora=lora or LoRAConfig(),
            device="cpu",
            kv_events_config=kv_events,
        )
        self.settings = GrpcSettings(
            port=0,
            api_keys=api_keys,
            limits=limits or Limits(),
            session_idle_timeout=session_idle_timeout,
            max_sessions=max_sessions,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            allow_runtime_lora_updating=allow_runtime_lora_updating,
            lora_root=lora_root,
            connection=connection or ConnectionSettings(),
            worker_protocol=worker_protocol,
        )
        self.tls = tls
        self.observer = observer
        self.in_process = in_process  # False: the engine core runs in a process of its own
        self.warm = warm  # False: stop before warm-up (the server is NOT_READY)
        self.max_requests = max_requests
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> ServerHarness:
        self._thread.start()
        self.run(self._start())
        return self

    async def _start(self) -> None:
        self.engine = AsyncEngine(
            self.config,
            observer=self.observer,
            max_requests=self.max_requests,
            in_process=self.in_process,
            core_observer=getattr(self.observer, "gate", None),
        )
        await self.engine.start()
        self.server = GrpcServer(self.engine, MODEL_NAME, self.settings, tls=self.tls)
        self.port = await self.server.start()
        if self.warm:
            await self.engine.warmup()
            await self.server.set_serving(True)

    def stop(self) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    async def _stop(self) -> None:
        await self.server.stop(grace=0.5)
        await self.engine.shutdown()

    # ------------------------------------------------------------------ helpers
    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        """Run a coroutine on the server's loop and wait for its result."""
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    @property
    def core(self) -> EngineCore:
        """The engine core itself: in-process harnesses only (tests that inject faults)."""
        client = self.engine.client
        assert isinstance(client, InprocCoreClient) and client.core is not None
        return client.core

    @property
    def core_pid(self) -> int:
        return self.engine.info.core_pid

    def kv_report(self, timeout: float = 30.0) -> IdleReport:
        """The core's account of requests and KV blocks, after every earlier command."""
        return self.run(self.engine.check_idle(timeout))

    def assert_idle(self, timeout: float = 30.0) -> None:
        """Every stream ended, no request in the engine, every KV block free."""
        assert self.run(self.engine.wait_idle(timeout)), "streams still open"
        report = self.kv_report(timeout)
        assert report.all_free, report
