"""The live TLS state of one server process, reloaded from the files on SIGHUP.

One ``TlsReloader`` serves both ports. gRPC: dynamic SSL credentials whose fetch callback
(called by grpc-core before every new handshake) hands over the reloaded certificate once.
REST: one ``ssl.SSLContext`` given to uvicorn and reloaded in place with
``load_cert_chain``. Either way new handshakes use the new certificate and connections
already open keep theirs. A reload that fails (a file half-written, a key that does not match)
is logged and changes nothing: the server keeps the certificate it has.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable
from typing import Any

import grpc

from tokenwire.server.telemetry.logs import get_logger
from tokenwire.server.tls.material import (
    TlsMaterial,
    check_loopback,
    load_chain,
    load_client_cas,
    load_material,
    loopback_name,
    server_context,
)
from tokenwire.server.tls.settings import TlsSettings

logger = get_logger("tokenwire.tls")


def _grpc_config(material: TlsMaterial) -> Any:
    return grpc.ssl_server_certificate_configuration(
        [(material.private_key, material.cert_chain)], material.ca_certs
    )


class TlsReloader:
    """Checks the files at construction (ValueError naming the flag) and on every reload."""

    def __init__(self, settings: TlsSettings) -> None:
        self.settings = settings
        self.material = load_material(settings)
        self.reloads = 0  # successful reloads so far
        self._lock = threading.Lock()  # the gRPC fetch callback runs on grpc-core threads
        self._pending: Any = None  # a reloaded gRPC configuration not yet handed over
        self._context: ssl.SSLContext | None = None
        self._listeners: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ gRPC
    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Server credentials whose certificate follows ``reload``. Client certificates:
        required and verified with ``--ssl-cert-reqs required``; otherwise not requested
        (grpc's Python API offers no request-but-optional mode)."""
        return grpc.dynamic_ssl_server_credentials(
            _grpc_config(self.material),
            self._fetch,
            require_client_authentication=self.settings.mutual,
        )

    def _fetch(self) -> Any:
        with self._lock:
            config, self._pending = self._pending, None
        return config  # None: keep the current certificate

    def loopback_credentials(self, host: str) -> tuple[grpc.ChannelCredentials, str | None]:
        """The in-process REST shim's credentials for its channel to this server, and the
        TLS name to check when the certificate does not name ``host``. Under mTLS the shim
        authenticates with the server's own certificate and key."""
        material = self.material
        peer = check_loopback(self.settings, material)
        mutual = self.settings.mutual
        credentials = grpc.ssl_channel_credentials(
            root_certificates=material.loopback_roots,
            private_key=material.private_key if mutual else None,
            certificate_chain=material.cert_chain if mutual else None,
        )
        return credentials, loopback_name(peer, host)

    # ------------------------------------------------------------------ REST
    def ssl_context(self) -> ssl.SSLContext:
        """The REST port's context (one object, reloaded in place)."""
        if self._context is None:
            self._context = server_context(self.settings)
        return self._context

    # ------------------------------------------------------------------ reload
    def on_reload(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after every successful reload (the REST shim's channel)."""
        self._listeners.append(callback)

    def reload(self) -> bool:
        """Re-read the files; True when the new certificate is in use for new handshakes."""
        try:
            material = load_material(self.settings)
            if self._context is not None:
                load_chain(self._context, self.settings)
                load_client_cas(self._context, self.settings)
        except ValueError as exc:
            logger.error("TLS reload failed; keeping the current certificate", error=str(exc))
            return False
        with self._lock:
            self._pending = _grpc_config(material)
            self.material = material
        self.reloads += 1
        logger.info("TLS certificates reloaded", certfile=self.settings.certfile)
        for callback in self._listeners:
            callback()
        return True
