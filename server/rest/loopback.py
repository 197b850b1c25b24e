"""The in-process REST shim's channel to its own gRPC server (``tokenwire serve``).

It is a real loopback TCP connection, so when the server serves TLS it uses TLS as well (a
plaintext side port would let every local process bypass mTLS): it trusts ``--ssl-ca-certs``
plus the server's own certificate, checks the certificate's first DNS name when it does not
name the bound address, and under mTLS presents the server's own certificate and key. After
each SIGHUP reload it opens a new channel with the new files.
"""

from __future__ import annotations

from tokenwire.server.rest.upstream import Upstream, open_channel
from tokenwire.server.telemetry.logs import get_logger
from tokenwire.server.tls.reloader import TlsReloader

logger = get_logger("tokenwire.rest")


def loopback_target(host: str, port: int) -> str:
    """Where a process reaches its own server bound on ``host``."""
    if host in ("", "0.0.0.0"):
        return f"127.0.0.1:{port}"
    if host == "::":
        return f"[::1]:{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def target_host(target: str) -> str:
    return target.rpartition(":")[0].strip("[]")


def check_loopback_tls(tls: TlsReloader, host: str) -> None:
    """At startup: ValueError (naming the flags) unless the shim could connect over TLS."""
    tls.loopback_credentials(target_host(loopback_target(host, 0)))


def loopback_upstream(target: str, max_message_bytes: int, tls: TlsReloader | None) -> Upstream:
    """The shim's ``Upstream`` to ``target``: plaintext, or TLS following ``tls`` reloads."""
    if tls is None:
        return Upstream.connect(target, max_message_bytes)
    host = target_host(target)
    upstream = Upstream.connect(target, max_message_bytes, *tls.loopback_credentials(host))

    def reconnect() -> None:
        try:
            credentials, name = tls.loopback_credentials(host)
        except ValueError as exc:
            logger.error("REST shim keeps its channel: reloaded TLS unusable", error=str(exc))
            return
        upstream.reconnect(open_channel(target, max_message_bytes, credentials, name))

    tls.on_reload(reconnect)
    return upstream
