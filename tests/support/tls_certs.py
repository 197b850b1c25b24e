"""Test PKI made with ``cryptography``: a CA, server certificates for 127.0.0.1 / localhost
and client certificates, written as PEM files. Small EC keys: generation takes milliseconds."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_DAY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Issued:
    """A certificate and its key as PEM files (and the bytes, for gRPC credentials)."""

    cert: Path
    key: Path

    @property
    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    @property
    def key_pem(self) -> bytes:
        return self.key.read_bytes()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(
    folder: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> Issued:
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / f"{stem}.crt", folder / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return Issued(cert_path, key_path)


class TestCA:
    """A self-signed CA that issues server and client certificates into ``folder``."""

    __test__ = False  # not a pytest test class

    def __init__(self, folder: Path, name: str = "tokenwire test CA") -> None:
        self.folder = folder
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY)
            .not_valid_after(now + 30 * _DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.files = _write(folder, name.replace(" ", "-"), self.cert, self.key)

    def issue(
        self,
        stem: str,
        common_name: str,
        *,
        dns: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
        server: bool = True,
        client: bool = True,
        valid: tuple[datetime.timedelta, datetime.timedelta] = (-_DAY, 30 * _DAY),
    ) -> Issued:
        """``valid``: the validity period, as offsets from now (default: a day ago to 30
        days ahead)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
        usages += [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now + valid[0])
            .not_valid_after(now + valid[1])
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return _write(self.folder, stem, builder.sign(self.key, hashes.SHA256()), key)

    def server_cert(
        self,
        stem: str = "server",
        valid: tuple[datetime.timedelta, datetime.timedelta] = (-_DAY, 30 * _DAY),
    ) -> Issued:
        """For 127.0.0.1 and localhost; usable as a client certificate too (the REST shim
        presents the server's certificate under mTLS)."""
        return self.issue(stem, "localhost", dns=("localhost",), ips=("127.0.0.1",), valid=valid)

    def client_cert(self, stem: str = "client") -> Issued:
        return self.issue(stem, f"{stem}.tokenwire.test", server=False)


def self_signed(folder: Path, stem: str = "selfsigned") -> Issued:
    """A self-signed server certificate for 127.0.0.1 / localhost (no CA)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = _name("localhost")
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _DAY)
        .not_valid_after(now + 30 * _DAY)
        .add_extension(san, critical=False)
        .sign(key, hashes.SHA256())
    )
    return _write(folder, stem, cert, key)


def serial_of(pem: bytes) -> int:
    return int(x509.load_pem_x509_certificate(pem).serial_number)
