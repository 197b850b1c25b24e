"""Run the REST shim with uvicorn inside the caller's event loop, and ``tokenwire rest``.

``tokenwire serve`` starts it next to the gRPC server (same loop, one loopback channel);
``tokenwire rest --grpc-target HOST:PORT`` runs it alone in front of a remote gRPC server.
The listening socket is bound before anything else starts, so a taken ``--port`` fails fast
with a message naming the flag; ``--port 0`` binds an ephemeral port.

HTTPS with ``--ssl-*`` (one ``ssl.SSLContext`` from ``TlsReloader``, reloaded in place on
SIGHUP); HTTP keep-alive and header timeouts from ``server/rest/connection.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import ssl
from collections.abc import Callable, Iterator

import grpc
import uvicorn

from tokenwire.server.rest.app import RestSettings, create_app
from tokenwire.server.rest.connection import (
    HttpConnectionSettings,
    add_http_connection_arguments,
    header_timeout_protocol,
    http_connection_settings,
)
from tokenwire.server.rest.loopback import loopback_target as loopback_target  # re-export
from tokenwire.server.rest.media_fetch import MediaFetchPolicy
from tokenwire.server.rest.responses_api.settings import (
    add_responses_arguments,
    responses_settings,
)
from tokenwire.server.rest.upstream import Upstream, open_channel
from tokenwire.server.telemetry.logs import (
    add_log_format_argument,
    configure_logging,
    get_logger,
)
from tokenwire.server.tls.reloader import TlsReloader
from tokenwire.server.tls.settings import add_ssl_arguments, tls_settings

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

    def __init__(
        self,
        settings: RestSettings,
        connection: HttpConnectionSettings | None = None,
        tls: TlsReloader | None = None,
    ) -> None:
        self.settings = settings
        self.connection = connection or HttpConnectionSettings()
        self.tls = tls
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
        timeout = self.connection.header_timeout
        config = uvicorn.Config(
            create_app(upstream, self.settings),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=self.connection.timeout_keep_alive,
            http="httptools" if timeout is None else header_timeout_protocol(timeout),
            ssl_context_factory=_context_factory(self.tls),
        )
        self._server = _EmbeddedServer(config)
        # Connections queue on the listening socket until uvicorn accepts them.
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        return self.port

    @property
    def url(self) -> str:
        host = self.settings.host
        scheme = "http" if self.tls is None else "https"
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{self.port}"

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            if self._sock is not None:
                self._sock.close()
            return
        self._server.should_exit = True
        await self._task


def _context_factory(
    tls: TlsReloader | None,
) -> Callable[[uvicorn.Config, Callable[[], ssl.SSLContext]], ssl.SSLContext] | None:
    """uvicorn's hook for our own (reloadable) context; None: plain HTTP."""
    if tls is None:
        return None
    context = tls.ssl_context()
    return lambda config, default: context


def add_rest_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=RestSettings.max_body_bytes,
        help="REST request bodies above this size get 413 (default 2 MiB)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="REST: gRPC deadline per request in seconds (504 when it passes; default none)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="fetch http(s) image URLs whose host is exactly one of these (case-insensitive; "
        "subdomains are not included), never from a private, loopback, link-local or "
        "reserved address; default: none (remote image URLs are refused)",
    )
    add_responses_arguments(p)
    add_http_connection_arguments(p)


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
        responses=responses_settings(args),
        media=MediaFetchPolicy.of(args.allowed_media_domains, args.max_image_bytes),
    )


def add_rest_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "rest", help="serve the OpenAI-compatible REST API in front of a tokenwire gRPC server"
    )
    p.add_argument("--grpc-target", default="127.0.0.1:50051", help="gRPC server HOST:PORT")
    p.add_argument(
        "--grpc-ca-certs",
        default=None,
        metavar="PEM",
        help="reach --grpc-target over TLS, verifying its certificate against this CA bundle",
    )
    p.add_argument(
        "--grpc-certfile",
        default=None,
        metavar="PEM",
        help="client certificate for a gRPC server that requires one (mTLS; implies TLS)",
    )
    p.add_argument("--grpc-keyfile", default=None, metavar="PEM", help="key of --grpc-certfile")
    p.add_argument("--host", default=RestSettings.host, help="address the REST port binds")
    p.add_argument(
        "--port", type=int, default=RestSettings.port, help="REST port (0: any free port)"
    )
    add_log_format_argument(p)
    add_rest_arguments(p)
    p.add_argument(
        "--max-image-bytes",
        type=int,
        default=MediaFetchPolicy.max_bytes,
        help="largest image fetched for --allowed-media-domains, in bytes (the gRPC server's "
        "own --max-image-bytes still applies; default: %(default)s)",
    )
    add_ssl_arguments(p)
    p.set_defaults(func=run_rest)


def _read_pem(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None


def upstream_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS credentials for ``--grpc-target`` (re-read on every call); None: plaintext."""
    if (args.grpc_certfile is None) != (args.grpc_keyfile is None):
        raise ValueError("--grpc-certfile and --grpc-keyfile go together")
    if args.grpc_ca_certs is None and args.grpc_certfile is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(args.grpc_ca_certs, "--grpc-ca-certs"),
        private_key=_read_pem(args.grpc_keyfile, "--grpc-keyfile"),
        certificate_chain=_read_pem(args.grpc_certfile, "--grpc-certfile"),
    )


def run_rest(args: argparse.Namespace) -> int:
    settings = rest_settings(args, args.port)
    connection = http_connection_settings(args)
    tls_config = tls_settings(args)
    tls = TlsReloader(tls_config) if tls_config is not None else None
    upstream_credentials(args)  # unreadable files fail here, before anything starts
    configure_logging(args.log_format)
    server = RestServer(settings, connection, tls)
    return asyncio.run(_serve_rest(args, server))


async def _serve_rest(args: argparse.Namespace, server: RestServer) -> int:
    server.bind()
    target = args.grpc_target
    upstream = Upstream(open_channel(target, credentials=upstream_credentials(args)), True)
    await server.start(upstream)
    logger.info("serving rest=%s grpc_target=%s", server.url, target)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def reload() -> None:  # SIGHUP: this port's certificate and the upstream client's
        if server.tls is not None:
            server.tls.reload()
        try:
            credentials = upstream_credentials(args)
        except ValueError as exc:
            logger.error("upstream TLS reload failed; keeping the current channel: %s", exc)
            return
        if credentials is not None:
            upstream.reconnect(open_channel(target, credentials=credentials))

    loop.add_signal_handler(signal.SIGHUP, reload)
    await stop.wait()
    await server.stop()
    await upstream.close()
    logger.info("stopped")
    return 0
