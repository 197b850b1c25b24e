"""Stored responses of the Responses API: per owner (the caller's API key), bounded.

An owner is a digest of the caller's bearer key ("anon" when it sends none), so one key
never sees, continues or deletes another's responses. Each owner holds at most
``max_count`` responses and ``max_bytes`` of them (their JSON and conversation), the oldest
going first; a response older than ``max_age`` seconds is gone. A stored response keeps its
KV blocks on the gRPC server (``retain_kv_as`` = its id) so a continuation prefills only the
new input; whatever leaves the store is returned to the caller, which releases those blocks
with the owner's own credentials (the store keeps no key). Responses of owners who never
come back are dropped from memory by age; their blocks are reclaimed by the engine's held
block budget.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenwire.v1 import common_pb2


@dataclass(frozen=True)
class ResponsesSettings:
    """``--responses-max-stored``, ``--responses-max-stored-bytes``, ``--responses-max-age``."""

    max_count: int = 256  # per owner
    max_bytes: int = 32 << 20  # per owner
    max_age: float = 3600.0  # seconds

    def __post_init__(self) -> None:
        if self.max_count < 0:
            raise ValueError("--responses-max-stored must be >= 0")
        if self.max_bytes <= 0:
            raise ValueError("--responses-max-stored-bytes must be > 0")
        if self.max_age <= 0:
            raise ValueError("--responses-max-age must be > 0")


@dataclass
class StoredResponse:
    id: str
    request_id: str  # the gRPC request id (for cancel while in progress)
    body: dict[str, Any]  # the response object as last known
    conversation: list[common_pb2.ChatMessage]  # input history + this response's output
    size: int = 0
    stored_at: float = 0.0
    retained: bool = False  # its KV blocks are kept under its id


def owner_of(authorization: str | None) -> str:
    """A digest of the caller's key: never the key itself."""
    if not authorization:
        return "anon"
    return hashlib.sha256(authorization.encode()).hexdigest()[:32]


def record_size(record: StoredResponse) -> int:
    conversation: int = sum(m.ByteSize() for m in record.conversation)
    return len(repr(record.body)) + conversation


@dataclass
class ResponseStore:
    settings: ResponsesSettings
    clock: Callable[[], float] = time.monotonic
    _owners: dict[str, OrderedDict[str, StoredResponse]] = field(default_factory=dict)
    _bytes: dict[str, int] = field(default_factory=dict)

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        self.expire(owner)
        return self._owners.get(owner, OrderedDict()).get(response_id)

    def put(self, owner: str, record: StoredResponse) -> list[StoredResponse]:
        """Store (or update) ``record``; returns the responses this pushed out."""
        dropped = self.expire(owner)
        if self.settings.max_count == 0:
            return [*dropped, record]
        records = self._owners.setdefault(owner, OrderedDict())
        old = records.pop(record.id, None)
        self._bytes[owner] = self._bytes.get(owner, 0) - (old.size if old else 0)
        record.size = record_size(record)
        if not record.stored_at:
            record.stored_at = self.clock()
        records[record.id] = record
        self._bytes[owner] += record.size
        while len(records) > self.settings.max_count or (
            self._bytes[owner] > self.settings.max_bytes and len(records) > 1
        ):
            dropped.append(self._pop(owner, next(iter(records))))
        if self._bytes[owner] > self.settings.max_bytes:  # one response alone is too large
            dropped.append(self._pop(owner, record.id))
        return dropped

    def delete(self, owner: str, response_id: str) -> StoredResponse | None:
        self.expire(owner)
        if response_id not in self._owners.get(owner, {}):
            return None
        return self._pop(owner, response_id)

    def expire(self, owner: str) -> list[StoredResponse]:
        """Drop responses past ``max_age``: ``owner``'s are returned (to release their KV
        blocks); other owners' are only forgotten."""
        limit = self.clock() - self.settings.max_age
        mine: list[StoredResponse] = []
        for who in list(self._owners):
            records = self._owners[who]
            while records and next(iter(records.values())).stored_at < limit:
                gone = self._pop(who, next(iter(records)))
                if who == owner:
                    mine.append(gone)
        return mine

    def _pop(self, owner: str, response_id: str) -> StoredResponse:
        records = self._owners[owner]
        record = records.pop(response_id)
        self._bytes[owner] -= record.size
        if not records:
            del self._owners[owner]
            del self._bytes[owner]
        return record

    def count(self, owner: str) -> int:
        return len(self._owners.get(owner, ()))
