"""Connection management of the REST port: HTTP keep-alive and a header read timeout.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but has no header
timeout: a client that sends its request line and headers a byte at a time holds the
connection for as long as it likes. ``HeaderTimeoutProtocol`` (uvicorn's httptools protocol)
starts a timer when a connection opens (after the TLS handshake, on HTTPS) and when the first
byte of each further request arrives, and stops it when the headers are complete. When it
fires the client gets ``408 Request Timeout`` and the connection is closed. The body and the
response are not timed here (``--request-timeout`` bounds the work).
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_408_BODY = b"request headers not received in time"
_REQUEST_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_408_BODY), _408_BODY)
)


@dataclass(frozen=True)
class HttpConnectionSettings:
    timeout_keep_alive: int = 5  # seconds an idle keep-alive connection stays open
    header_timeout: float | None = 10.0  # seconds to receive a request's headers; None: off

    def __post_init__(self) -> None:
        if self.timeout_keep_alive <= 0:
            raise ValueError("--timeout-keep-alive must be > 0")
        if self.header_timeout is not None and self.header_timeout <= 0:
            raise ValueError("--header-timeout must be > 0 (0 on the command line turns it off)")


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request's headers."""

    header_timeout: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:  # no response under way
            self.transport.write(_REQUEST_TIMEOUT_408)
        self.transport.close()


def header_timeout_protocol(timeout: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn's ``http=`` with this timeout (seconds)."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": timeout})


def add_http_connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=HttpConnectionSettings.timeout_keep_alive,
        metavar="S",
        help="REST: close an idle HTTP keep-alive connection after this many seconds (default 5)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=HttpConnectionSettings.header_timeout,
        metavar="S",
        help="REST: close a connection (408) whose request headers are not complete this many "
        "seconds after it opened or its request began (default 10; 0: off)",
    )


def http_connection_settings(args: argparse.Namespace) -> HttpConnectionSettings:
    header = args.header_timeout
    return HttpConnectionSettings(args.timeout_keep_alive, None if header == 0 else header)
