"""A certificate's validity period, read from its DER (no third-party parser needed).

Startup and every reload refuse a server certificate outside its validity period: served, it
would make every verifying client fail its handshake. Only the fields needed are walked:
``Certificate -> TBSCertificate -> [version], serial, signature, issuer, validity``.
"""

from __future__ import annotations

import datetime
import re
import ssl

_UTC_TIME, _GENERALIZED_TIME, _VERSION = 0x17, 0x18, 0xA0
_FIRST = re.compile(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", re.DOTALL)


def _element(der: bytes, pos: int) -> tuple[int, int, int]:
    """``(tag, start, end)`` of the contents of the DER element at ``pos``."""
    tag, length = der[pos], der[pos + 1]
    pos += 2
    if length & 0x80:
        size = length & 0x7F
        length = int.from_bytes(der[pos : pos + size], "big")
        pos += size
    if pos + length > len(der):
        raise ValueError("truncated")
    return tag, pos, pos + length


def _time(tag: int, text: str) -> datetime.datetime:
    if tag == _UTC_TIME:  # YYMMDDHHMMSSZ, years 1950-2049 (RFC 5280)
        parsed = datetime.datetime.strptime(text, "%y%m%d%H%M%SZ")
        if parsed.year >= 2050:
            parsed = parsed.replace(year=parsed.year - 100)
    elif tag == _GENERALIZED_TIME:  # YYYYMMDDHHMMSSZ
        parsed = datetime.datetime.strptime(text, "%Y%m%d%H%M%SZ")
    else:
        raise ValueError("not a time")
    return parsed.replace(tzinfo=datetime.UTC)


def validity(pem: str) -> tuple[datetime.datetime, datetime.datetime]:
    """``(not_before, not_after)`` of the first certificate in ``pem``; ValueError if the
    certificate cannot be read."""
    try:
        block = _FIRST.search(pem)
        if block is None:
            raise ValueError("no certificate")
        der = ssl.PEM_cert_to_DER_cert(block.group(0))
        _, tbs, _ = _element(der, _element(der, 0)[1])
        tag, _, pos = _element(der, tbs)
        if tag != _VERSION:  # v1 certificates have no version field
            pos = tbs
        for _ in range(3):  # serial number, signature algorithm, issuer
            pos = _element(der, pos)[2]
        _, start, _ = _element(der, pos)
        times = []
        for _ in range(2):
            tag, first, start = _element(der, start)
            times.append(_time(tag, der[first:start].decode("ascii")))
    except (IndexError, UnicodeDecodeError, ValueError):
        raise ValueError("cannot read the certificate's validity period") from None
    return times[0], times[1]


def check_validity(pem: str, flag: str, path: str, now: datetime.datetime | None = None) -> None:
    """ValueError naming ``flag`` unless the first certificate of ``pem`` is valid ``now``."""
    try:
        not_before, not_after = validity(pem)
    except ValueError as exc:
        raise ValueError(f"{flag} {path}: {exc}") from None
    now = now or datetime.datetime.now(datetime.UTC)
    if now > not_after:
        raise ValueError(
            f"{flag} {path}: the certificate expired at {not_after:%Y-%m-%d %H:%M:%S} UTC; "
            "verifying clients would refuse it"
        )
    if now < not_before:
        raise ValueError(
            f"{flag} {path}: the certificate is not valid before "
            f"{not_before:%Y-%m-%d %H:%M:%S} UTC; verifying clients would refuse it"
        )
