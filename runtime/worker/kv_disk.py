"""The disk tier's file (``--kv-offloading-disk-path``; docs/kv-tiers.md): one preallocated
file of fixed-size records, one KV block each, read and written at their offsets.

Why one file of slots rather than a file per block: the footprint is reserved at startup (a
full disk fails the start, not a save mid-serve), a save or an eviction creates and unlinks
nothing (no directory churn at eviction rates), and the bookkeeping is the host tier's slot
allocator (``core/host_tier.py``) unchanged: records are all one size, so LRU by count is LRU
by size.

A record is a header, then the block's bytes (all layers, K and V, the cache's storage dtype),
padded to 4 KiB. The header holds a format version, the fingerprint of the model and KV layout
(``layout_fingerprint``), the block hash, the payload's length and crc32, a write sequence
number (LRU order for a warm restart) and its own crc32. A read checks all of it against what
the scheduler expects; a record that fails (corrupt, truncated, another model's, another
hash's) is never served: the read reports it and its header is zeroed, so no later start
takes it over either. Writes are not fsynced: a record torn by a crash fails its crc.

Warm restart: ``scan`` reads every header at startup and returns the records whose fingerprint
matches (the newest per hash), oldest write first; the engine core seeds the disk tier's index
with them. The file is locked (``flock``) so two servers never share it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import struct
import zlib
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"TWKV"
_HEAD = struct.Struct("<4sHH16s32sIIQ")  # magic, version, hash len, fingerprint, hash,
_HEADER = struct.Struct(f"<{_HEAD.size}sI")  # payload len, payload crc32, seq; header crc32
HEADER_BYTES = _HEADER.size
_ALIGN = 1 << 12  # records start on 4 KiB pages


def layout_fingerprint(*parts: object) -> bytes:
    """16 bytes naming what a record's bytes mean: model, dtype, block size, layout."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def record_bytes(payload_bytes: int) -> int:
    return -(-(HEADER_BYTES + payload_bytes) // _ALIGN) * _ALIGN


def disk_file(directory: str, rank: int, tp_rank: int = 0, tp_size: int = 1) -> Path:
    """The file of data-parallel rank ``rank`` (and tensor-parallel rank ``tp_rank`` of
    ``tp_size``: each holds its own shard of every record)."""
    shard = f".tp{tp_rank}of{tp_size}" if tp_size > 1 else ""
    return Path(directory) / f"tokenwire-kv-tier.dp{rank}{shard}.bin"


class DiskStore:
    """``num_slots`` records of ``payload_bytes`` each in ``path`` (created or reused)."""

    def __init__(self, path: Path, num_slots: int, payload_bytes: int, fingerprint: bytes) -> None:
        self.path = path
        self.num_slots = num_slots
        self.payload_bytes = payload_bytes
        self.record_bytes = record_bytes(payload_bytes)
        self.fingerprint = fingerprint
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(self._fd)
            raise ValueError(
                f"--kv-offloading-disk-path: {path} is in use by another server ({err})"
            ) from err
        size = num_slots * self.record_bytes
        if os.fstat(self._fd).st_size != size:
            os.ftruncate(self._fd, size)
        fallocate = getattr(os, "posix_fallocate", None)  # not on macOS
        try:  # reserve the blocks now: a full disk fails the start, not a save
            if fallocate is not None:
                fallocate(self._fd, 0, size)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                self.close()
                raise ValueError(
                    f"--kv-offloading-disk-size: no room for {size} bytes in {path.parent}"
                ) from err
            log.warning("kv disk tier: could not preallocate %s (%s); sparse file", path, err)
        self._seq = 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops the lock
            self._fd = -1

    # ------------------------------------------------------------------ records
    def write(self, slot: int, block_hash: bytes, payload: bytes | memoryview) -> None:
        """Write one record (a failed write is logged: its read will fail the checks)."""
        self._seq += 1
        head = _HEAD.pack(
            MAGIC,
            FORMAT_VERSION,
            len(block_hash),
            self.fingerprint,
            block_hash,
            len(payload),
            zlib.crc32(payload),
            self._seq,
        )
        try:
            os.pwrite(self._fd, _HEADER.pack(head, zlib.crc32(head)) + payload, self._offset(slot))
        except OSError as err:
            log.warning("kv disk tier: write of slot %d failed: %s", slot, err)

    def read(self, slot: int, block_hash: bytes) -> bytes | None:
        """The payload of ``slot`` if its record is intact and holds ``block_hash`` for this
        model; else None, and the record is invalidated (never served, never restored)."""
        want = HEADER_BYTES + self.payload_bytes
        try:
            data = os.pread(self._fd, want, self._offset(slot))
        except OSError as err:
            log.warning("kv disk tier: read of slot %d failed: %s", slot, err)
            data = b""
        header = self._parse(data[:HEADER_BYTES])
        payload = data[HEADER_BYTES:]
        if (
            header is None
            or header[0] != block_hash
            or len(payload) != self.payload_bytes
            or zlib.crc32(payload) != header[1]
        ):
            log.warning("kv disk tier: record in slot %d is corrupt or stale: ignored", slot)
            self.invalidate(slot)
            return None
        return payload

    def invalidate(self, slot: int) -> None:
        try:
            os.pwrite(self._fd, bytes(HEADER_BYTES), self._offset(slot))
        except OSError as err:
            log.warning("kv disk tier: could not invalidate slot %d: %s", slot, err)

    def invalidate_all(self) -> None:
        """Zero every record's header (``reset_prefix_cache``): none is served or restored."""
        for slot in range(self.num_slots):
            self.invalidate(slot)

    def scan(self) -> list[tuple[bytes, int]]:
        """Records this model can use, (hash, slot) oldest write first (warm restart)."""
        newest: dict[bytes, tuple[int, int]] = {}
        for slot in range(self.num_slots):
            header = self._parse(os.pread(self._fd, HEADER_BYTES, self._offset(slot)))
            if header is None:
                continue
            block_hash, _, seq = header
            if block_hash not in newest or newest[block_hash][0] < seq:
                newest[block_hash] = (seq, slot)
            self._seq = max(self._seq, seq)
        ordered = sorted(newest.items(), key=lambda item: item[1][0])
        return [(block_hash, slot) for block_hash, (_, slot) in ordered]

    # ------------------------------------------------------------------ helpers
    def _offset(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"disk slot {slot} out of range {self.num_slots}")
        return slot * self.record_bytes

    def _parse(self, raw: bytes) -> tuple[bytes, int, int] | None:
        """(hash, payload crc, seq) of a valid header for this model, else None."""
        if len(raw) != HEADER_BYTES:
            return None
        head, crc = _HEADER.unpack(raw)
        if zlib.crc32(head) != crc:
            return None
        magic, version, hash_len, fingerprint, block_hash, length, payload_crc, seq = _HEAD.unpack(
            head
        )
        if (
            magic != MAGIC
            or version != FORMAT_VERSION
            or fingerprint != self.fingerprint
            or length != self.payload_bytes
            or not 0 < hash_len <= len(block_hash)
        ):
            return None
        return block_hash[:hash_len], payload_crc, seq
