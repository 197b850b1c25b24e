"""Chained block hashes of the prefix cache and the extra keys that go into them.

``h_i = sha256(h_{i-1} + tokens_i + extra_i)`` with ``h_{-1} = b""``, tokens encoded as
little-endian uint32; ``extra_0`` carries the ``cache_salt`` and the LoRA adapter (the chain
carries them on), and a block that an image's placeholder run overlaps also carries the
image's content hash. KV events publish the same extra keys as text pieces.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from tokenwire.runtime.core.request import Request
from tokenwire.runtime.multimodal import image_extra_keys, image_extra_pieces


def hash_block_tokens(parent_hash: bytes, token_bytes: bytes, extra_keys: bytes) -> bytes:
    """Chained sha256 of one full block (32 bytes). Collisions are cryptographically unlikely."""
    return hashlib.sha256(parent_hash + token_bytes + extra_keys).digest()


def request_extra_keys(request: Request) -> bytes:
    """Extra keys of a request's first block: its cache salt and its LoRA adapter, so
    requests of different salts or adapters never share blocks (the chain carries it on)."""
    extra = salt_extra_keys(request.cache_salt)
    if request.lora_request is not None:
        extra += request.lora_request.cache_key
    return extra


def request_extra_pieces(request: Request) -> tuple[str, ...]:
    """``request_extra_keys`` as the UTF-8 text pieces KV events publish (same bytes)."""
    pieces = [] if request.cache_salt is None else ["salt:" + request.cache_salt]
    if request.lora_request is not None:
        pieces.append(request.lora_request.cache_key.decode())
    return tuple(pieces)


def block_extra_pieces(request: Request, index: int, block_size: int) -> tuple[object, ...] | None:
    """Block ``index``'s extra keys as KV events publish them, in hash order (None if none)."""
    first = request_extra_pieces(request) if index == 0 else ()
    start = index * block_size
    pieces = (*first, *image_extra_pieces(request.images, start, start + block_size))
    return pieces or None


def salt_extra_keys(cache_salt: str | None) -> bytes:
    """Extra keys of a request's first block; ``None`` and ``""`` hash differently."""
    return b"" if cache_salt is None else b"salt:" + cache_salt.encode("utf-8")


def extend_block_hashes(
    hashes: list[bytes],
    request: Request,
    num_full: int,
    block_size: int,
    pack: Callable[..., bytes],
) -> list[bytes]:
    """Hash ``request``'s full blocks up to ``num_full`` onto ``hashes`` (its chain so far:
    earlier hashes are kept, only new blocks are hashed); ``pack``: a block's token bytes."""
    bs = block_size
    tokens = request.token_ids
    parent = hashes[-1] if hashes else b""
    for i in range(len(hashes), num_full):
        extra = request_extra_keys(request) if i == 0 else b""
        if request.images:  # blocks overlapping an image carry its content hash
            extra += image_extra_keys(request.images, i * bs, i * bs + bs)
        parent = hash_block_tokens(parent, pack(*tokens[i * bs : i * bs + bs]), extra)
        hashes.append(parent)
    return hashes
