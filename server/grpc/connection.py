"""Connection management of the gRPC port: keepalive, connection age, message sizes and the
concurrent-RPC cap, as frozen settings, their flags and grpc-core channel arguments.

``max_connection_age`` makes the server send GOAWAY to each connection after that long (with
``±10%`` jitter from grpc-core), so clients reconnect and L4 load balancers spread long-lived
HTTP/2 connections over new replicas; calls still running get ``max_connection_age_grace``
to finish before the connection is closed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

_MS = 1000.0


@dataclass(frozen=True)
class ConnectionSettings:
    """None: grpc-core's default (unlimited age, no concurrent-RPC cap)."""

    keepalive_time: float = 7200.0  # seconds between server pings on an idle connection
    keepalive_timeout: float = 20.0  # seconds to wait for the ping ack before closing
    max_connection_age: float | None = None
    max_connection_age_grace: float | None = None
    max_concurrent_rpcs: int | None = None
    max_receive_message_bytes: int | None = None  # None: GrpcSettings.max_message_bytes
    max_send_message_bytes: int | None = None

    def __post_init__(self) -> None:
        positive: dict[str, float | int | None] = {
            "--grpc-keepalive-time": self.keepalive_time,
            "--grpc-keepalive-timeout": self.keepalive_timeout,
            "--grpc-max-connection-age": self.max_connection_age,
            "--grpc-max-concurrent-rpcs": self.max_concurrent_rpcs,
            "--max-receive-message-bytes": self.max_receive_message_bytes,
            "--max-send-message-bytes": self.max_send_message_bytes,
        }
        for flag, value in positive.items():
            if value is not None and value <= 0:
                raise ValueError(f"{flag} must be > 0")
        grace = self.max_connection_age_grace
        if grace is not None and grace < 0:
            raise ValueError("--grpc-max-connection-age-grace must be >= 0")

    def send_bytes(self, max_message_bytes: int) -> int:
        """The largest response message the server sends."""
        return self.max_send_message_bytes or max_message_bytes

    def server_options(self, max_message_bytes: int) -> list[tuple[str, int]]:
        """grpc-core channel arguments of the server."""
        receive = self.max_receive_message_bytes or max_message_bytes
        send = self.send_bytes(max_message_bytes)
        options = [
            ("grpc.max_receive_message_length", receive),
            ("grpc.max_send_message_length", send),
            ("grpc.keepalive_time_ms", round(self.keepalive_time * _MS)),
            ("grpc.keepalive_timeout_ms", round(self.keepalive_timeout * _MS)),
        ]
        if self.max_connection_age is not None:
            options.append(("grpc.max_connection_age_ms", round(self.max_connection_age * _MS)))
        if self.max_connection_age_grace is not None:
            grace_ms = round(self.max_connection_age_grace * _MS)
            options.append(("grpc.max_connection_age_grace_ms", grace_ms))
        return options


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--grpc-keepalive-time",
        type=float,
        default=ConnectionSettings.keepalive_time,
        metavar="S",
        help="gRPC: ping a connection after this many idle seconds (default 7200)",
    )
    p.add_argument(
        "--grpc-keepalive-timeout",
        type=float,
        default=ConnectionSettings.keepalive_timeout,
        metavar="S",
        help="gRPC: close a connection whose ping is not answered within this (default 20)",
    )
    p.add_argument(
        "--grpc-max-connection-age",
        type=float,
        default=None,
        metavar="S",
        help="gRPC: send GOAWAY after a connection has lived this long (±10%%), so clients "
        "reconnect and load balancers rebalance (default: never)",
    )
    p.add_argument(
        "--grpc-max-connection-age-grace",
        type=float,
        default=None,
        metavar="S",
        help="gRPC: time calls get to finish after that GOAWAY (default: unlimited)",
    )
    p.add_argument(
        "--grpc-max-concurrent-rpcs",
        type=int,
        default=None,
        help="gRPC: calls in progress at once (streams, sessions and health watches "
        "included) before new ones get RESOURCE_EXHAUSTED (default: no cap)",
    )
    p.add_argument(
        "--max-receive-message-bytes",
        type=int,
        default=None,
        help="gRPC: largest request message (default: --max-message-bytes)",
    )
    p.add_argument(
        "--max-send-message-bytes",
        type=int,
        default=None,
        help="gRPC: largest response message (default: --max-message-bytes)",
    )


def connection_settings(args: argparse.Namespace) -> ConnectionSettings:
    return ConnectionSettings(
        keepalive_time=args.grpc_keepalive_time,
        keepalive_timeout=args.grpc_keepalive_timeout,
        max_connection_age=args.grpc_max_connection_age,
        max_connection_age_grace=args.grpc_max_connection_age_grace,
        max_concurrent_rpcs=args.grpc_max_concurrent_rpcs,
        max_receive_message_bytes=args.max_receive_message_bytes,
        max_send_message_bytes=args.max_send_message_bytes,
    )
