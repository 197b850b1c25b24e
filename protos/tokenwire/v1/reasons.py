"""``ErrorReason`` <-> the string ``google.rpc.ErrorInfo.reason`` carries (hand-written).

The wire keeps the bare UPPER_SNAKE name: ``ERROR_REASON_QUEUE_FULL`` travels as
``"QUEUE_FULL"``. Server, REST shim and client library convert with these two functions only,
so the enum in ``errors.proto`` is the one list of reasons.
"""

from __future__ import annotations

from tokenwire.v1.errors_pb2 import ERROR_REASON_UNSPECIFIED, ErrorReason

PREFIX = "ERROR_REASON_"


def reason_name(reason: ErrorReason) -> str:
    """The ``ErrorInfo.reason`` string of ``reason``: its name without ``ERROR_REASON_``."""
    return str(ErrorReason.Name(reason)).removeprefix(PREFIX)


def parse_reason(name: str | None) -> ErrorReason:
    """The enum value an ``ErrorInfo.reason`` string names; UNSPECIFIED when the string is
    empty or names a reason this version does not know (a newer server's)."""
    if not name or name.startswith(PREFIX):
        return ERROR_REASON_UNSPECIFIED
    try:
        value: ErrorReason = ErrorReason.Value(PREFIX + name)
    except ValueError:
        return ERROR_REASON_UNSPECIFIED
    return value
