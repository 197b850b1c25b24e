"""The ``--ssl-*`` flags (vLLM's names) and their frozen settings.

``--ssl-cert-reqs`` takes ``none`` / ``optional`` / ``required`` or vLLM's integer form
(``ssl.CERT_NONE`` = 0, ``CERT_OPTIONAL`` = 1, ``CERT_REQUIRED`` = 2). ``required`` is mTLS:
every client presents a certificate that verifies against ``--ssl-ca-certs``.
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass


class CertReqs(enum.Enum):
    """Client certificates: not asked for, verified when sent, or required and verified."""

    NONE = "none"
    OPTIONAL = "optional"
    REQUIRED = "required"


_INT_FORMS = {"0": CertReqs.NONE, "1": CertReqs.OPTIONAL, "2": CertReqs.REQUIRED}


def parse_cert_reqs(value: str) -> CertReqs:
    """``none``/``optional``/``required`` (any case) or vLLM's ``0``/``1``/``2``."""
    text = value.strip().lower()
    if text in _INT_FORMS:
        return _INT_FORMS[text]
    try:
        return CertReqs(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid --ssl-cert-reqs {value!r}: use none, optional, required (or 0, 1, 2)"
        ) from None


@dataclass(frozen=True)
class TlsSettings:
    """Where the server's certificate, key and client CA live (PEM files)."""

    certfile: str
    keyfile: str | None = None  # None: the key is in certfile
    ca_certs: str | None = None  # CA bundle that client certificates must chain to
    cert_reqs: CertReqs = CertReqs.NONE

    def __post_init__(self) -> None:
        if self.cert_reqs is not CertReqs.NONE and self.ca_certs is None:
            raise ValueError(
                f"--ssl-cert-reqs {self.cert_reqs.value} needs --ssl-ca-certs "
                "(the CA that client certificates are verified against)"
            )

    @property
    def mutual(self) -> bool:
        return self.cert_reqs is CertReqs.REQUIRED


def add_ssl_arguments(p: argparse.ArgumentParser) -> None:
    """The server's TLS flags (both ports: gRPC and REST)."""
    p.add_argument(
        "--ssl-certfile",
        default=None,
        metavar="PEM",
        help="serve gRPC and REST over TLS with this certificate (chain); reloaded on SIGHUP",
    )
    p.add_argument(
        "--ssl-keyfile",
        default=None,
        metavar="PEM",
        help="private key of --ssl-certfile (default: inside --ssl-certfile)",
    )
    p.add_argument(
        "--ssl-ca-certs",
        default=None,
        metavar="PEM",
        help="CA bundle that client certificates are verified against (--ssl-cert-reqs)",
    )
    p.add_argument(
        "--ssl-cert-reqs",
        type=parse_cert_reqs,
        default=CertReqs.NONE,
        metavar="{none,optional,required}",
        help="client certificates: none (default), optional (REST: verified when sent; "
        "gRPC: not requested), required (mTLS on both ports); vLLM's 0/1/2 also work",
    )


def tls_settings(args: argparse.Namespace) -> TlsSettings | None:
    """The flags as settings; None without ``--ssl-certfile``. ValueErrors name the flag."""
    if args.ssl_certfile is None:
        for flag in ("ssl_keyfile", "ssl_ca_certs"):
            if getattr(args, flag) is not None:
                name = "--" + flag.replace("_", "-")
                raise ValueError(f"{name} needs --ssl-certfile (the server certificate)")
        if args.ssl_cert_reqs is not CertReqs.NONE:
            raise ValueError("--ssl-cert-reqs needs --ssl-certfile (the server certificate)")
        return None
    return TlsSettings(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
