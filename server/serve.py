"""``tokenwire serve [MODEL]``: load, warm up, serve gRPC (and REST) until SIGTERM, then drain.

The OpenAI-compatible REST shim runs in the same event loop on ``--port`` (default 8000;
``--port 0`` picks a free port, ``--disable-rest`` turns it off) and reaches the gRPC server
over loopback through one shared channel. Both ports are bound before the model loads.

The engine core runs in a process of its own (``--engine-in-process``: on a thread here).
Startup errors (bad flags, model not found, KV cache too small) exit non-zero before the
server reports SERVING, with a message naming the flag to change. SIGTERM/SIGINT: health
goes NOT_SERVING, new calls get UNAVAILABLE, in-flight requests finish up to
``--shutdown-timeout``, then the process exits 0. When the engine core dies, in-flight
requests end UNAVAILABLE at once, the server drains the same way and exits 1.

TLS (``--ssl-*``) covers both ports; the certificate files are checked before the model
loads (exit 2 naming the flag) and reloaded on SIGHUP (and, with ``--reload-interval``, when
they or ``--api-key-file`` change: ``file_watch``). The REST shim's loopback channel uses
TLS too (it is a real TCP connection): it trusts ``--ssl-ca-certs`` plus the server's own
certificate, and under mTLS presents the server's certificate as its client certificate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from prometheus_client import start_http_server

from tokenwire.runtime.config import EngineConfig
from tokenwire.runtime.engine.async_engine import AsyncEngine
from tokenwire.runtime.engine_args import EngineArgs
from tokenwire.runtime.errors import EngineDeadError
from tokenwire.server.file_watch import FileWatcher, watched_paths
from tokenwire.server.grpc.server import GrpcServer, GrpcSettings
from tokenwire.server.rest.app import RestSettings
from tokenwire.server.rest.loopback import check_loopback_tls, loopback_target, loopback_upstream
from tokenwire.server.rest.server import RestServer, rest_settings
from tokenwire.server.serve_args import (
    ServeOptions,
    add_serve_arguments,
    grpc_settings,
    serve_options,
)
from tokenwire.server.telemetry.core import Telemetry
from tokenwire.server.telemetry.logs import configure_logging, get_logger
from tokenwire.server.telemetry.tracing import tracing_settings
from tokenwire.server.tenants.registry import TenantRegistry
from tokenwire.server.tls.reloader import TlsReloader
from tokenwire.server.tls.settings import tls_settings

logger = get_logger("tokenwire.serve")


def add_serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="serve a model over gRPC and OpenAI-compatible REST")
    add_serve_arguments(p)  # server/serve_args.py
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    # Validates every engine flag before any model work (--tensor-parallel-size: only 1).
    config = EngineArgs.from_cli_args(args).create_engine_config()
    settings = grpc_settings(args)
    if settings.allow_runtime_lora_updating and not config.lora.enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    tracing = tracing_settings(args)
    tls = _load_tls(args)  # every certificate problem exits 2 here, before the model loads
    configure_logging(args.log_format)
    options = serve_options(args)
    telemetry = Telemetry(tracing, metrics_compat=options.metrics_compat)
    tenants = TenantRegistry(settings.tenants, settings.api_keys)
    rest = None
    if not args.disable_rest:
        rest = rest_settings(args, args.port)
        if options.metrics_port is None:  # else /metrics lives on its own port only
            keys = tenants if tenants.auth_required else None  # any tenant's key
            rest = replace(rest, metrics=telemetry.exposition, metrics_keys=keys)
    try:
        return asyncio.run(_serve(config, settings, rest, telemetry, options, tls, tenants))
    finally:
        telemetry.shutdown()  # flush spans still in the exporter's queue


async def _serve(
    config: EngineConfig,
    settings: GrpcSettings,
    rest_config: RestSettings | None,
    telemetry: Telemetry,
    options: ServeOptions,
    tls: TlsReloader | None = None,
    tenants: TenantRegistry | None = None,
) -> int:
    rest = None
    if rest_config is not None:
        rest = RestServer(rest_config, options.http, tls)
        rest.bind()  # a taken --port fails before the model loads
    engine = AsyncEngine(
        config,
        observer=telemetry,
        max_requests=options.max_requests,
        in_process=options.engine_in_process,
    )
    stop = _signal_event()
    # SIGHUP: new handshakes on both ports use the reloaded certificate (never a shutdown);
    # the key file is re-read (a bad one keeps the old tenants; in-flight requests keep theirs).
    tenants = tenants or TenantRegistry(settings.tenants, settings.api_keys)
    hooks: list[Callable[[], object]] = [tls.reload] if tls is not None else []
    if settings.tenants is not None:
        hooks.append(tenants.reload)
    watcher = _reload_on(hooks, options.reload_interval, tls, settings)
    await engine.start()  # the core loads the model (in its own process by default)
    try:
        return await _serve_started(engine, settings, rest, telemetry, options, stop, tls, tenants)
    finally:
        if watcher is not None:
            watcher.cancel()
        await engine.shutdown()


async def _serve_started(
    engine: AsyncEngine,
    settings: GrpcSettings,
    rest: RestServer | None,
    telemetry: Telemetry,
    options: ServeOptions,
    stop: asyncio.Event,
    tls: TlsReloader | None = None,
    tenants: TenantRegistry | None = None,
) -> int:
    telemetry.attach(engine)
    model = engine.info.served_model_name
    server = GrpcServer(engine, model, settings, telemetry, tls, tenants)
    port = await server.start()  # NOT_SERVING; requests get NOT_READY until warm
    engine.on_dead(stop.set)  # a dead core: drain, then exit non-zero for the supervisor
    upstream = None
    if rest is not None:
        target = loopback_target(settings.host, port)
        upstream = loopback_upstream(target, settings.max_message_bytes, tls)
        await rest.start(upstream)  # answers 503 NOT_READY until warm, like gRPC
    metrics_server = _start_metrics_server(telemetry, options.metrics_host, options.metrics_port)
    if not server.tenants.auth_required:
        logger.warning("no --api-key configured: the server accepts every caller")
    with contextlib.suppress(EngineDeadError):  # a core dying now is handled below
        await engine.warmup()
        await server.set_serving(True)
        _log_serving(engine, server, port, rest, metrics_server, telemetry)
        await stop.wait()
    if engine.is_dead:
        logger.error("the engine core died; draining and exiting", exit_code=1)
    logger.info("draining", timeout_s=options.shutdown_timeout, in_flight=engine.num_in_flight)
    await server.drain(options.shutdown_timeout)  # REST keeps answering: new calls get 503
    if rest is not None and upstream is not None:
        await rest.stop()
        await upstream.close()
    if metrics_server is not None:
        metrics_server.shutdown()
    await server.stop(grace=1.0)
    logger.info("stopped")
    return 1 if engine.is_dead else 0


def _log_serving(
    engine: AsyncEngine,
    server: GrpcServer,
    port: int,
    rest: RestServer | None,
    metrics_server: Any,
    telemetry: Telemetry,
) -> None:
    """The startup line: plain text for people and greps, the same facts as fields."""
    info = engine.info
    rest_url = rest.url if rest is not None else "disabled"
    grpc_address = f"{server.settings.host}:{port}"
    parser = server.tool_call_parser
    source = "flag" if server.settings.tool_call_parser is not None else "chat_template"
    logger.info(
        f"serving model={info.served_model_name} device={info.device} dtype={info.dtype} "
        f"kv_blocks={info.num_kv_blocks} quantization={info.quantization or 'none'} "
        f"weights={info.weight_bytes / 2**20:.0f}MiB tp={info.tensor_parallel_size} "
        f"grpc={grpc_address} rest={rest_url} {_parser_text(parser, source)} ",
        model=info.served_model_name,
        device=info.device,
        dtype=info.dtype,
        kv_blocks=info.num_kv_blocks,
        quantization=info.quantization,
        weight_bytes=info.weight_bytes,
        kv_cache_dtype=info.kv_cache_dtype,
        tensor_parallel_size=info.tensor_parallel_size,
        grpc=grpc_address,
        rest=rest_url,
        metrics_port=metrics_server.server_port if metrics_server is not None else None,
        tracing=telemetry.settings.endpoint,
        engine_core_pid=info.core_pid,
        max_loras=info.max_loras,
        lora_adapters=[a.lora_name for a in info.lora_adapters],
        tool_call_parser=parser,
        tool_call_parser_source=source if parser is not None else None,
    )


def _parser_text(parser: str | None, source: str) -> str:
    """The startup line's account of which tool-call parser reads tool_choice "auto"."""
    if parser is None:
        return "tool_call_parser=none (tool_choice auto needs --tool-call-parser)"
    how = "--tool-call-parser" if source == "flag" else "from the chat template"
    return f"tool_call_parser={parser} ({how})"


def _load_tls(args: argparse.Namespace) -> TlsReloader | None:
    """The certificate files, checked; with REST on, also that the shim can connect."""
    tls_config = tls_settings(args)
    if tls_config is None:
        return None
    tls = TlsReloader(tls_config)
    if not args.disable_rest:
        check_loopback_tls(tls, args.host)
    return tls


def _reload_on(
    hooks: list[Callable[[], object]],
    interval: float | None,
    tls: TlsReloader | None,
    settings: GrpcSettings,
) -> asyncio.Task[None] | None:
    """Run every reload hook (certificates, the tenant key file) on SIGHUP and, with
    ``--reload-interval``, when one of their files changes; returns the watching task."""

    def reload() -> None:
        for hook in hooks:
            hook()

    def on_signal() -> None:
        logger.info("SIGHUP: reloading", reloadable=len(hooks))
        reload()

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_signal)
    t = None if tls is None else tls.settings
    tls_files = [] if t is None else [t.certfile, t.keyfile, t.ca_certs]
    paths = watched_paths(tls_files, [None if settings.tenants is None else settings.tenants.path])
    if interval is None:
        return None
    if not paths:
        logger.warning("--reload-interval: nothing to watch (no --ssl-* files or --api-key-file)")
        return None
    return asyncio.get_running_loop().create_task(FileWatcher(paths, reload).run(interval))


def _signal_event() -> asyncio.Event:
    """Set on SIGTERM / SIGINT (and by whoever else decides the server must stop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def _start_metrics_server(telemetry: Telemetry, host: str, port: int | None) -> Any:
    """Prometheus on its own port (for ``--disable-rest``); None without ``--metrics-port``."""
    if port is None:
        return None
    assert telemetry.metrics is not None
    try:
        server, _ = start_http_server(port, addr=host, registry=telemetry.metrics.registry)
    except OSError as exc:
        raise ValueError(
            f"cannot bind {host}:{port} ({exc.strerror}): choose another --metrics-port"
        ) from None
    return server
