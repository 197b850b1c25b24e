"""Pool of paged KV-cache blocks: ref counts, the LRU free queue and the prefix-cache map.

Block 0 is the NULL block: never allocated, never freed, excluded from every count. Block
tables are padded with it, so its slots are scratch space that no request owns.

Invariants (checked by ``check_invariants``):
- a non-null block is in the free queue  <=>  its ``ref_cnt == 0``;
- ``cached[h] is b``  <=>  ``b.block_hash == h`` (no two blocks share a hash, no stale hash);
- a free block that still holds a hash is *evictable*: it keeps its KV and can be revived by a
  prefix hit (``touch``) until ``get_new_blocks`` pops it for reuse, which drops the hash.

The free queue is an ``OrderedDict`` used as an O(1) LRU list: the front is the least recently
freed block (evicted first), ``free_blocks`` appends at the tail, and ``touch`` removes an
arbitrary block in O(1). No torch here: this runs on the scheduler thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

from tokenwire.runtime.core.kv_events import KVEventRecorder
from tokenwire.runtime.scheduler_output import NULL_BLOCK_ID


class KVBlock:
    """Metadata of one physical KV block of ``block_size`` token slots."""

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # Number of live request block tables holding this block.
        self.ref_cnt = 0
        # Chained hash of the full block's tokens while it is in the prefix cache, else None.
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class BlockPool:
    """All ``num_blocks`` blocks (including the null block) and their free/cached state."""

    def __init__(
        self, num_blocks: int, enable_caching: bool, events: KVEventRecorder | None = None
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Indexed by block_id.
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        # block_id -> None, front = least recently freed. Initially in id order.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        # block hash -> the one block caching it (in use, or free but evictable).
        self._cached: dict[bytes, KVBlock] = {}
        # Records hashes leaving the map and cache resets (None: KV events are off).
        self.events = events
        # KV tiers hook: called with a cached block about to be reused (its KV still intact).
        self.on_evict: Callable[[KVBlock], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can own (the null block excluded)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0``, including evictable cached ones."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks with ``ref_cnt > 0``, in [0, 1]."""
        return 1.0 - len(self._free_queue) / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop ``num_blocks`` from the front of the free queue, evicting their cached hashes.

        Returned blocks have ``ref_cnt == 1`` and no hash. Raises ``ValueError`` if there are
        not enough free blocks (callers check ``num_free_blocks`` first).
        """
        if num_blocks > len(self._free_queue):
            raise ValueError(
                f"cannot allocate {num_blocks} blocks, only {len(self._free_queue)} are free"
            )
        out: list[KVBlock] = []
        for _ in range(num_blocks):
            block = self.blocks[self._free_queue.popitem(last=False)[0]]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        # The block is about to hold other tokens: its hash must leave the map *and* the
        # block, or a later lookup of the old hash would return the wrong KV.
        block_hash = block.block_hash
        assert block_hash is not None
        if self.on_evict is not None:  # KV tiers: save it to the host tier first
            self.on_evict(block)
        if self._cached.get(block_hash) is block:
            del self._cached[block_hash]
            if self.events is not None:
                self.events.removed(block_hash)
        block.block_hash = None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (prefix hit); revives evictable blocks."""
        free_queue = self._free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                del free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue tail in order.

        Blocks keep their hash: they stay evictable cached blocks until reused.
        """
        free_queue = self._free_queue
        for block in blocks_in_eviction_order:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free_queue[block.block_id] = None

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        """The block caching ``block_hash`` (in use or evictable), or None."""
        return self._cached.get(block_hash)

    def cache_full_block(self, block: KVBlock, block_hash: bytes) -> bool:
        """Register a full block under ``block_hash``; True if the map gained the hash.

        No-op if caching is off, if the block is already cached, or if another block already
        caches this hash (the duplicate stays uncached; the map keeps one block per hash).
        """
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False) while any block is in use."""
        if len(self._free_queue) != self.num_usable_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def cached_hashes(self) -> list[bytes]:
        """Every hash in the prefix-cache map (tests compare it with a subscriber's view)."""
        return list(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free queue in eviction order (front first). For tests and debugging."""
        return list(self._free_queue)

    def check_invariants(self, expected_ref_cnts: Mapping[int, int]) -> None:
        """Raise AssertionError unless the pool is consistent with the owners' tables.

        ``expected_ref_cnts`` maps block_id -> number of live tables holding it.
        """
        null = self.null_block
        _check(null.ref_cnt == 0 and null.block_hash is None, f"null block was used: {null!r}")
        _check(NULL_BLOCK_ID not in self._free_queue, "null block is in the free queue")
        _check(NULL_BLOCK_ID not in expected_ref_cnts, "null block is in a block table")
        for block in self.blocks[1:]:
            expected = expected_ref_cnts.get(block.block_id, 0)
            _check(block.ref_cnt == expected, f"{block!r}: expected ref_cnt {expected}")
            in_queue = block.block_id in self._free_queue
            _check(in_queue == (block.ref_cnt == 0), f"{block!r}: in free queue = {in_queue}")
            if block.block_hash is not None:
                owner = self._cached.get(block.block_hash)
                _check(owner is block, f"{block!r}: stale hash, map holds {owner!r}")
        for block_hash, block in self._cached.items():
            _check(block.block_hash == block_hash, f"{block!r}: map entry with another hash")
        _check(self.enable_caching or not self._cached, "blocks cached with caching disabled")


def _check(condition: bool, message: str) -> None:
    # Explicit raise instead of ``assert`` so the checks survive ``python -O``.
    if not condition:
        raise AssertionError(message)
