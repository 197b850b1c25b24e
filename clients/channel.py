"""Channels of the client library: TLS options and the default retry policy.

Retry policy (gRPC service config, on by default; ``retry=None`` turns it off): calls to
``tokenwire.v1.GenerationService`` and ``tokenwire.v1.ModelService`` that fail with
UNAVAILABLE or RESOURCE_EXHAUSTED (e.g. the server's queue is full, ``QUEUE_FULL``) are
retried up to 4 attempts in all, with exponential backoff from 0.2 s to 2 s (jittered by
gRPC). gRPC only retries a call that has not been committed: once the server has sent response
headers — which tokenwire does only after the engine admitted the request — nothing is
retried, so a retry never runs a generation twice. ``retryThrottling`` stops retrying
when more than half of the recent attempts to a server failed. The same JSON works from any
gRPC language (``grpc.service_config`` channel argument; ``json.dumps(policy.service_config())``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import grpc

RETRY_SERVICES = ("tokenwire.v1.GenerationService", "tokenwire.v1.ModelService")


@dataclass(frozen=True)
class RetryPolicy:
    """gRPC's retryPolicy for every tokenwire method (see the module docstring)."""

    max_attempts: int = 4  # the first attempt included (gRPC caps this at 5)
    initial_backoff: float = 0.2  # seconds
    max_backoff: float = 2.0
    backoff_multiplier: float = 2.0
    status_codes: tuple[str, ...] = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
    throttle_max_tokens: int = 10
    throttle_token_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not 2 <= self.max_attempts <= 5:
            raise ValueError("max_attempts must be 2..5 (gRPC caps retries at 5 attempts)")
        if self.initial_backoff <= 0 or self.max_backoff < self.initial_backoff:
            raise ValueError("backoffs must be > 0 with max_backoff >= initial_backoff")

    def service_config(self) -> dict[str, Any]:
        return {
            "methodConfig": [
                {
                    "name": [{"service": name} for name in RETRY_SERVICES],
                    "retryPolicy": {
                        "maxAttempts": self.max_attempts,
                        "initialBackoff": f"{self.initial_backoff}s",
                        "maxBackoff": f"{self.max_backoff}s",
                        "backoffMultiplier": self.backoff_multiplier,
                        "retryableStatusCodes": list(self.status_codes),
                    },
                }
            ],
            "retryThrottling": {
                "maxTokens": self.throttle_max_tokens,
                "tokenRatio": self.throttle_token_ratio,
            },
        }


DEFAULT_RETRY_POLICY = RetryPolicy()


@dataclass(frozen=True)
class TlsOptions:
    """Connect over TLS. Paths to PEM files; ``ca_certs=None`` uses gRPC's default roots.
    ``certfile``/``keyfile``: the client certificate a server with mTLS requires.
    ``server_name``: the name to check in the server certificate instead of the target's."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError("TLS client certificate: certfile and keyfile go together")

    def credentials(self) -> grpc.ChannelCredentials:
        """Read the files (now: a rotated client certificate is picked up by new clients)."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_certs, "ca_certs"),
            private_key=_read(self.keyfile, "keyfile"),
            certificate_chain=_read(self.certfile, "certfile"),
        )


def _read(path: str | None, name: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read TLS {name} {path}: {exc.strerror or exc}") from None


def channel_options(
    max_message_bytes: int,
    retry: RetryPolicy | None = DEFAULT_RETRY_POLICY,
    tls: TlsOptions | None = None,
    load_balancing: str | None = None,
) -> list[tuple[str, int | str]]:
    """``load_balancing``: gRPC's client-side policy, e.g. ``round_robin`` to spread calls over
    every address a target resolves to (a Kubernetes headless Service:
    ``dns:///tokenwire-headless.NAMESPACE.svc:50051``); None: gRPC's default (pick_first)."""
    options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    config: dict[str, Any] = {} if retry is None else retry.service_config()
    if load_balancing is not None:
        config["loadBalancingConfig"] = [{load_balancing: {}}]
    options.append(("grpc.enable_retries", 0 if retry is None else 1))
    if config:
        options.append(("grpc.service_config", json.dumps(config)))
    if tls is not None and tls.server_name is not None:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def open_channel(
    target: str, options: list[tuple[str, int | str]], tls: TlsOptions | None
) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.credentials(), options=options)


def open_aio_channel(
    target: str, options: list[tuple[str, int | str]], tls: TlsOptions | None
) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.credentials(), options=options)


def add_tls_client_arguments(p: argparse.ArgumentParser) -> None:
    """``--tls``, ``--tls-ca``, ``--tls-cert``, ``--tls-key``, ``--tls-server-name``."""
    p.add_argument("--tls", action="store_true", help="gRPC over TLS (gRPC's default roots)")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="CA bundle (implies --tls)")
    p.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="client certificate (mTLS; implies --tls)"
    )
    p.add_argument("--tls-key", default=None, metavar="PEM", help="key of --tls-cert")
    p.add_argument(
        "--tls-server-name", default=None, help="name to check in the server certificate"
    )


def tls_from_args(args: argparse.Namespace) -> TlsOptions | None:
    wanted = args.tls or any(
        v is not None for v in (args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    )
    if not wanted:
        return None
    return TlsOptions(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
