"""Certificate material read from the ``--ssl-*`` files and checked before it is used.

Every problem is a ``ValueError`` naming the flag: a file that cannot be read, one without a
PEM certificate or key, a server certificate outside its validity period, a key that does
not match the certificate, a CA bundle without a certificate. ``check_loopback`` also
proves, with an in-memory TLS handshake, that the REST shim can reach its own gRPC server:
the server certificate verifies against the shim's roots (``--ssl-ca-certs`` plus
``--ssl-certfile`` itself, so a self-signed certificate is its own root), and under mTLS the
shim's client certificate (the server's own) verifies against ``--ssl-ca-certs``.
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass
from typing import Any

from tokenwire.server.tls.settings import CertReqs, TlsSettings
from tokenwire.server.tls.validity import check_validity

_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n.*?-----END \1-----\r?\n?", re.DOTALL)
_VERIFY_MODES = {
    CertReqs.NONE: ssl.CERT_NONE,
    CertReqs.OPTIONAL: ssl.CERT_OPTIONAL,
    CertReqs.REQUIRED: ssl.CERT_REQUIRED,
}


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None


def _blocks(data: bytes, kind: str) -> bytes:
    """The PEM blocks whose label ends with ``kind`` (CERTIFICATE, PRIVATE KEY), joined."""
    found = [m.group(0) for m in _PEM_BLOCK.finditer(data) if m.group(1).endswith(kind.encode())]
    return b"".join(b if b.endswith(b"\n") else b + b"\n" for b in found)


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes as gRPC takes them, and the names the server certificate is valid for."""

    cert_chain: bytes
    private_key: bytes
    ca_certs: bytes | None

    @property
    def loopback_roots(self) -> bytes:
        """What the in-process REST shim trusts: the client CA bundle and the server's own
        certificate chain (a self-signed certificate is its own root)."""
        return (self.ca_certs or b"") + self.cert_chain


def load_material(settings: TlsSettings) -> TlsMaterial:
    """Read and check the files; the certificate and key must belong together."""
    raw = _read(settings.certfile, "--ssl-certfile")
    chain = _blocks(raw, "CERTIFICATE")
    if not chain:
        raise ValueError(f"--ssl-certfile {settings.certfile} holds no PEM certificate")
    # Expired or not yet valid: every verifying client would fail (startup and reloads).
    check_validity(chain.decode("ascii", "replace"), "--ssl-certfile", settings.certfile)
    key_flag, key_path = "--ssl-keyfile", settings.keyfile
    if key_path is None:
        key_flag, key_path = "--ssl-certfile", settings.certfile  # key and cert in one file
    key = _blocks(raw if settings.keyfile is None else _read(key_path, key_flag), "PRIVATE KEY")
    if not key:
        raise ValueError(f"{key_flag} {key_path} holds no PEM private key")
    ca = None
    if settings.ca_certs is not None:
        ca = _blocks(_read(settings.ca_certs, "--ssl-ca-certs"), "CERTIFICATE")
        if not ca:
            raise ValueError(f"--ssl-ca-certs {settings.ca_certs} holds no PEM certificate")
    server_context(settings)  # the key matches the certificate; OpenSSL can parse both
    return TlsMaterial(chain, key, ca)


def load_chain(ctx: ssl.SSLContext, settings: TlsSettings) -> None:
    """``ctx.load_cert_chain`` with errors that name the flag."""
    try:
        ctx.load_cert_chain(settings.certfile, settings.keyfile)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(
                f"--ssl-keyfile {settings.keyfile or settings.certfile} does not match "
                f"the certificate in --ssl-certfile {settings.certfile}"
            ) from None
        raise ValueError(
            f"cannot load --ssl-certfile {settings.certfile} / --ssl-keyfile "
            f"{settings.keyfile or settings.certfile}: {exc.reason or exc}"
        ) from None
    except OSError as exc:
        raise ValueError(f"cannot read --ssl-certfile / --ssl-keyfile: {exc}") from None


def load_client_cas(ctx: ssl.SSLContext, settings: TlsSettings) -> None:
    if settings.ca_certs is None:
        return
    try:
        ctx.load_verify_locations(cafile=settings.ca_certs)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"cannot load --ssl-ca-certs {settings.ca_certs}: {exc}") from None


def server_context(settings: TlsSettings) -> ssl.SSLContext:
    """A TLS 1.2+ server context for the REST port (client certificates per --ssl-cert-reqs)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    load_chain(ctx, settings)
    load_client_cas(ctx, settings)
    ctx.verify_mode = _VERIFY_MODES[settings.cert_reqs]
    return ctx


def check_loopback(settings: TlsSettings, material: TlsMaterial) -> dict[str, Any]:
    """Handshake in memory as the REST shim will; returns the server certificate as
    ``SSLSocket.getpeercert()`` decodes it. ValueError when the shim could not connect."""
    server = server_context(settings)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False  # names are checked by gRPC (see loopback_name)
    client.load_verify_locations(cadata=material.loopback_roots.decode("ascii", "replace"))
    if settings.mutual:
        load_chain(client, settings)  # the shim presents the server's own certificate
    try:
        return _handshake(server, client)
    except _HandshakeFailed as exc:
        why = exc.reason
        if exc.side == "server":
            raise ValueError(
                "--ssl-cert-reqs required with the REST shim: the shim presents the server "
                "certificate (--ssl-certfile) as its client certificate, and it does not "
                f"verify against --ssl-ca-certs ({why}); issue it from that CA (with the "
                "clientAuth usage if it lists usages) or run with --disable-rest"
            ) from None
        raise ValueError(
            "the REST shim cannot verify the gRPC server certificate (--ssl-certfile) against "
            f"--ssl-ca-certs or the certificate itself ({why}): put the issuing CA into "
            "--ssl-ca-certs or the full chain into --ssl-certfile, or run with --disable-rest"
        ) from None


class _HandshakeFailed(Exception):
    def __init__(self, side: str, reason: str) -> None:
        super().__init__(f"{side}: {reason}")
        self.side, self.reason = side, reason


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> dict[str, Any]:
    bios = [ssl.MemoryBIO() for _ in range(4)]
    client = client_ctx.wrap_bio(bios[0], bios[1], server_side=False)
    server = server_ctx.wrap_bio(bios[2], bios[3], server_side=True)
    pending = {"client": client, "server": server}
    for _ in range(16):
        for side, obj in list(pending.items()):
            try:
                obj.do_handshake()
                del pending[side]
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as exc:
                raise _HandshakeFailed(side, exc.reason or str(exc)) from None
        bios[2].write(bios[1].read())
        bios[0].write(bios[3].read())
        if not pending:
            break
    if pending:
        raise _HandshakeFailed("client", "handshake did not finish")
    peer = client.getpeercert()
    return dict(peer) if peer else {}


def certificate_names(peer: dict[str, Any]) -> list[tuple[str, str]]:
    """``(kind, name)`` of a decoded certificate's DNS and IP names; its common name as a DNS
    name when it has none."""
    kinds = {"DNS": "DNS", "IP Address": "IP"}
    names = [(kinds[k], str(v)) for k, v in peer.get("subjectAltName", ()) if k in kinds]
    if names:
        return names
    return [("DNS", str(v)) for rdn in peer.get("subject", ()) for k, v in rdn if k == "commonName"]


def loopback_name(peer: dict[str, Any], host: str) -> str | None:
    """The TLS name the shim checks when the certificate does not name ``host``: the
    certificate's first DNS name (a wildcard filled in); None when ``host`` is covered."""
    names = certificate_names(peer)
    if any(name == host for _, name in names):
        return None
    dns = [name for kind, name in names if kind == "DNS"]
    if not dns:
        return None  # only other IP addresses: gRPC will refuse, as it should
    return "tokenwire" + dns[0][1:] if dns[0].startswith("*") else dns[0]
