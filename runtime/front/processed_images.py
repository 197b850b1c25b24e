"""``ProcessedImageCache``: what the image processor made of an image, kept by its encoded
bytes, so a chat that carries the same image again (every later turn of a session re-renders
its whole transcript; a REST client re-sends its conversation) neither decodes nor processes
it again.

An entry is one image's ``ProcessedImage``: its processed pixels (LLaVA, Gemma 3: [channels,
height, width]; Qwen-VL: its flattened patches), its patch grid (dynamic resolution) and the
content hash of both (``pixel_hash``, the engine's prefix-cache and encoder-cache key). The
key is the SHA-256 of the image's encoded bytes and the pixel limit it was decoded under
(``--max-image-pixels``): the model's image processor and its settings are fixed for the
cache's life (one cache per ``TokenizerPool``, one pool per served model), so nothing else
changes what the processor makes of those bytes. A request's ``cache_salt`` (an isolated
tenant's, or a client's own) is part of the key: a hit is a timing signal (a decoded and
processed image costs milliseconds to hundreds of them), so a salted request never hits, nor
warms, an entry another salt made. A hit hands out the very arrays a miss
made, so the prompt ids and ``ImageInput``s of a hit are those of a miss, bit for bit; nobody
writes into an ``ImageInput``'s pixels (the engine copies them out).

Bounded by bytes (``--mm-processor-cache-bytes``: the pixels' ``nbytes`` plus a fixed
per-entry overhead), least recently used first out; an entry larger than the whole budget is
not kept; 0 keeps nothing. Thread-safe: the tokenizer pool renders on several threads. Two
threads missing the same image at once both process it (the same result) and the entry is
kept once.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

DEFAULT_CACHE_BYTES = 256 << 20
# Per entry, beside its pixels: the key, the grid, the hash and the record itself.
ENTRY_OVERHEAD_BYTES = 512


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the model's image processor made it."""

    pixels: np.ndarray  # [channels, height, width], or [patches, features] with ``grid``
    grid: tuple[int, int, int] | None  # Qwen-VL's patch grid (t, h, w); None: fixed size
    content_hash: str  # ``pixel_hash(pixels, grid)``

    @property
    def nbytes(self) -> int:
        return int(self.pixels.nbytes) + ENTRY_OVERHEAD_BYTES


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    entries: int
    bytes: int


def image_key(data: bytes, max_pixels: int, cache_salt: str | None = None) -> bytes:
    """The cache key of an image's encoded bytes decoded under ``max_pixels`` for a request
    with ``cache_salt`` (None: shared; a salt's entries serve that salt only)."""
    digest = hashlib.sha256(data)
    digest.update(b":max_pixels=%d" % max_pixels)
    if cache_salt is not None:
        digest.update(b":salt=" + cache_salt.encode("utf-8"))
    return digest.digest()


class ProcessedImageCache:
    """LRU of ``ProcessedImage``s by key, at most ``max_bytes`` in all (0: keeps nothing)."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError("--mm-processor-cache-bytes must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, ProcessedImage] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def get(self, key: bytes) -> ProcessedImage | None:
        """The entry of ``key`` (now the most recently used), counted as a hit or a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry

    def put(self, key: bytes, image: ProcessedImage) -> None:
        """Keep ``image`` under ``key``, evicting the least recently used entries to fit."""
        size = image.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            while self._entries and self._bytes + size > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
            self._entries[key] = image
            self._bytes += size

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, len(self._entries), self._bytes)
