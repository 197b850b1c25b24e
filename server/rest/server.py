"""Run the REST shim with uvicorn inside the caller's event loop, and ``tokenwire rest``.

``tokenwire serve`` starts it next to the gRPC server (same loop, one loopback channel);
``tokenwire rest --grpc-target HOST:PORT`` runs it alone in front of a remote gRPC server.
The listening socket is bound before anything else starts, so a taken ``--port`` fails fast
with a message naming the flag; ``--port 0`` binds an ephemeral port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
from collections.abc import Iterator

import uvicorn

from tokenwire.server.rest.app import RestSettings, create_app
from tokenwire.server.rest.upstream import Upstream
from tokenwire.server.telemetry.logs import (
    add_log_format_argument,
    configure_logging,
    get_logger,
)

logger = get_logger("tokenwire.rest")


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: the host process owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"cannot bind {host}:{port} ({exc.strerror}): choose another --port"
        ) from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class RestServer:
    """The FastAPI app on a uvicorn server running as a task of the current loop.

    ``bind`` (synchronous, before any slow start-up work) claims the port; ``start`` serves.
    """

    def __init__(self, settings: RestSettings) -> None:
        self.settings = settings
        self.port = 0
        self._sock: socket.socket | None = None
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    def bind(self) -> int:
        """Claim the listening socket; returns the bound port (useful with port 0)."""
        self._sock = _bind(self.settings.host, self.settings.port)
        self.port = self._sock.getsockname()[1]
        return self.port

    async def start(self, upstream: Upstream) -> int:
        """Serve the app over ``upstream`` (binding first if ``bind`` was not called)."""
        sock = (
            self._sock if self._sock is not None else _bind(self.settings.host, self.settings.port)
        )
        self._sock, self.port = sock, sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(upstream, self.settings),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        self._server = _EmbeddedServer(config)
        # Connections queue on the listening socket until uvicorn accepts them.
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        return self.port

    @property
    def url(self) -> str:
        host = self.settings.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            if self._sock is not None:
                self._sock.close()
            return
        self._server.should_exit = True
        await self._task


def loopback_target(host: str, port: int) -> str:
    """Where a process reaches its own server bound on ``host``."""
    if host in ("", "0.0.0.0"):
        return f"127.0.0.1:{port}"
    if host == "::":
        return f"[::1]:{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def add_rest_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=2 << 20,
        help="REST request bodies above this size get 413 (default 2 MiB)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="REST: gRPC deadline per request in seconds (504 when it passes; default none)",
    )


def rest_settings(args: argparse.Namespace, port: int) -> RestSettings:
    if args.max_request_body_bytes <= 0:
        raise ValueError("--max-request-body-bytes must be > 0")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ValueError("--request-timeout must be > 0")
    return RestSettings(
        host=args.host,
        port=port,
        max_body_bytes=args.max_request_body_bytes,
        request_timeout=args.request_timeout,
    )


def add_rest_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "rest", help="serve the OpenAI-compatible REST API in front of a tokenwire gRPC server"
    )
    p.add_argument("--grpc-target", default="127.0.0.1:50051", help="gRPC server HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_log_format_argument(p)
    add_rest_arguments(p)
    p.set_defaults(func=run_rest)


def run_rest(args: argparse.Namespace) -> int:
    settings = rest_settings(args, args.port)
    configure_logging(args.log_format)
    return asyncio.run(_serve_rest(args.grpc_target, settings))


async def _serve_rest(target: str, settings: RestSettings) -> int:
    server = RestServer(settings)
    server.bind()
    upstream = Upstream.connect(target)
    await server.start(upstream)
    logger.info("serving rest=%s grpc_target=%s", server.url, target)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
    await upstream.close()
    logger.info("stopped")
    return 0
