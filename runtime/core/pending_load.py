"""One KV-tier load in flight or waiting for its request's admission (``kv_connector.py``)."""

from __future__ import annotations

import time

from tokenwire.runtime.core.block_pool import KVBlock
from tokenwire.runtime.core.request import Request


class PendingLoad:
    """One load the connector started: the device blocks it holds and the slots it reads."""

    __slots__ = (
        "block_hashes",
        "cancelled",
        "disk_slots",
        "done",
        "hit_blocks",
        "load_id",
        "new_blocks",
        "request",
        "request_id",
        "slots",
        "started",
    )

    def __init__(
        self,
        load_id: int,
        request: Request,
        hit_blocks: list[KVBlock],
        new_blocks: list[KVBlock],
        block_hashes: list[bytes],
        slots: list[int],
        disk_slots: list[int],
    ) -> None:
        self.load_id = load_id
        self.request = request  # its tokens name the loaded blocks in KV events
        self.request_id = request.request_id
        self.hit_blocks = hit_blocks  # the device hit, referenced so it is not evicted
        self.new_blocks = new_blocks  # written by the load
        self.block_hashes = block_hashes  # of new_blocks
        self.slots = slots  # host slots read, and disk records read
        self.disk_slots = disk_slots
        self.started = time.monotonic()
        self.done = False
        self.cancelled = False

    def blocks(self) -> list[KVBlock]:
        return [*self.hit_blocks, *self.new_blocks]
