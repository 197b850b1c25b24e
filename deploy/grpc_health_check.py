"""One ``grpc.health.v1.Health/Check`` call: exit 0 when the server answers SERVING, else 1.

The image's HEALTHCHECK and the Helm chart's exec probes (used when the server serves TLS:
the kubelet's native ``grpc:`` probe cannot do TLS) run it inside the container:

    python /opt/tokenwire/grpc_health_check.py                      # plaintext, port 50051
    python /opt/tokenwire/grpc_health_check.py --port 50051 \\
        --tls-ca /etc/tokenwire/tls/tls.crt --tls-server-name tokenwire.ns.svc \\
        [--tls-cert /etc/tokenwire/tls/tls.crt --tls-key /etc/tokenwire/tls/tls.key]  # mTLS

Needs only grpcio and grpcio-health-checking (tokenwire's own dependencies), so a probe does
not import the model runtime. The answer (or the error) is printed on one line: Kubernetes
shows it in the probe's failure event.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _read(paths: list[str]) -> bytes:
    return b"".join(Path(path).read_bytes() for path in paths)


def _channel(args: argparse.Namespace) -> grpc.Channel:
    target = f"{args.host}:{args.port}"
    if not args.tls_ca and not args.tls_cert:
        return grpc.insecure_channel(target)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(args.tls_ca) if args.tls_ca else None,
        private_key=_read([args.tls_key]) if args.tls_key else None,
        certificate_chain=_read([args.tls_cert]) if args.tls_cert else None,
    )
    options = []
    if args.tls_server_name:  # the name the certificate is issued for, not the loopback address
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    return grpc.secure_channel(target, credentials, options=options)


def check(args: argparse.Namespace) -> tuple[bool, str]:
    """(serving, what happened) for one Check call."""
    try:
        with _channel(args) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=args.service)
            reply = stub.Check(request, timeout=args.timeout)
    except grpc.RpcError as exc:
        return False, f"{exc.code().name}: {exc.details()}"
    except OSError as exc:  # an unreadable --tls-* file
        return False, f"cannot read {exc.filename}: {exc.strerror}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--service", default="", help="health service name (default: the server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds for the call")
    p.add_argument(
        "--tls-ca",
        action="append",
        default=[],
        metavar="PEM",
        help="trusted roots (repeatable); any --tls-* option turns TLS on",
    )
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="client certificate (mTLS)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    p.add_argument(
        "--tls-server-name",
        default=None,
        help="DNS name to verify in the server certificate (default: --host)",
    )
    args = p.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    return args


def main(argv: list[str] | None = None) -> int:
    serving, what = check(parse_args(argv))
    print(what)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
