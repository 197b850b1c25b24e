"""API keys shared by the gRPC interceptor and the REST shim's ``/metrics``: the one-header
Bearer rule and a constant-time check against keys stored as hashes. No gRPC, no runtime."""

from __future__ import annotations

import hashlib
import hmac
from typing import Protocol


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


def bearer_of(values: list[str]) -> str | None:
    """The key of a request's one ``authorization: Bearer <key>`` header (scheme matched
    case-insensitively, RFC 7235), from the values of every such header; None when absent,
    malformed or sent more than once."""
    if len(values) != 1:
        return None
    scheme, _, token = values[0].strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


class KeyCheck(Protocol):
    """Whether a bearer token is a valid key (``KeyChecker``, or the tenant registry)."""

    def is_valid(self, token: str | None) -> bool: ...


class KeyChecker:
    """Constant-time membership of a bearer token in the configured keys (stored hashed)."""

    def __init__(self, api_keys: tuple[str, ...]) -> None:
        self._digests = tuple(_digest(k) for k in api_keys)

    def is_valid(self, token: str | None) -> bool:
        if token is None:
            return False
        candidate = _digest(token)
        valid = False
        for digest in self._digests:  # no early exit: time does not depend on which key
            valid |= hmac.compare_digest(candidate, digest)
        return valid
