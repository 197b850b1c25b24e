"""Per-request block tables over the ``BlockPool``, with prefix caching over full blocks.

The scheduler drives it (vLLM v1 shape): for a request with nothing computed,
``get_computed_blocks`` finds the prefix hit, then ``allocate_slots`` takes those blocks plus new
ones; each later step ``allocate_slots`` grows the table for the next chunk or decode token;
``free`` releases everything (finish, abort, preempt). Every request that reached this manager
(even one whose allocation failed) must be ``free``d once it leaves the scheduler.

Block hashes are chained (``block_hashes``): requests with different salts or adapters never
share blocks, nor do prompts that differ only in an image from the image on. Only full blocks are
hashed, incrementally as tokens arrive. Full blocks are cached when *allocated*, before the
forward runs (as vLLM v1): a request scheduled later in the same step may hit them, which is
correct because every layer writes its K/V before attention reads it.

Sliding windows: when every layer of the model attends within a window (Mistral, Phi-3), the
blocks wholly before the current window can never be read again. ``allocate_slots`` frees
them (leading table entries become the null block; ``num_skipped_blocks`` counts them), so a
long request holds about one window of blocks, not its whole context. They stay cached
(evictable) for other requests' prefix hits.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

from tokenwire.runtime.core.block_hashes import block_extra_pieces, extend_block_hashes
from tokenwire.runtime.core.block_pool import BlockPool, KVBlock
from tokenwire.runtime.core.kv_events import KVEventRecorder
from tokenwire.runtime.core.request import Request
from tokenwire.runtime.core.request_blocks import RequestBlocks, check, check_tables


class KVCacheManager:
    """Paged KV-cache bookkeeping for the scheduler. Pure Python; block 0 is the null block."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        sliding_window: int | None = None,
        kv_events: KVEventRecorder | None = None,
    ) -> None:
        """``sliding_window``: the largest window when every layer has one (None: some layer
        attends to the whole context, nothing is ever skipped). ``kv_events``: records the
        blocks cached, evicted and cleared (None: KV events are off)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching, kv_events)
        self.kv_events = kv_events
        self._pack_block = struct.Struct(f"<{block_size}I").pack
        self._requests: dict[str, RequestBlocks] = {}
        # Tables of finished requests kept referenced for a holder (a session), by holder id.
        self._held: dict[str, RequestBlocks] = {}
        # Monotonic counters, in tokens: queried by get_computed_blocks, and found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # KV tiers hook: block references held outside request tables (a KV connector's
        # loads), counted by ``check_invariants``.
        self.external_refs: Callable[[], dict[int, int]] | None = None

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_tokens_capacity(self) -> int:
        return self.block_pool.num_usable_blocks * self.block_size

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's live block table (callers must not mutate it); [] if unknown."""
        state = self._requests.get(request_id)
        return [] if state is None else state.block_ids

    def get_block_hashes(self, request_id: str) -> list[bytes]:
        """The request's full-block hashes computed so far (do not mutate); [] if unknown."""
        state = self._requests.get(request_id)
        return [] if state is None else state.block_hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks: (block ids, hit tokens). Takes no references.

        The hit covers only blocks lying fully within the first ``num_tokens - 1`` tokens, so
        at least one token is always left to compute (its logits give the next token).
        """
        if not self.enable_prefix_caching:
            return [], 0
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = RequestBlocks()
        max_hit_blocks = max(0, request.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(
            state.block_hashes, request, max_hit_blocks, self.block_size, self._pack_block
        )
        hit_ids: list[int] = []
        for i in range(max_hit_blocks):
            block = self.block_pool.get_cached_block(hashes[i])
            if block is None:
                break
            hit_ids.append(block.block_id)
        num_hit_tokens = len(hit_ids) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hit_ids, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_block_ids: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Own enough blocks for ``num_computed + num_new_computed + num_new_tokens`` tokens.

        ``new_computed_block_ids`` (the prefix hit) is accepted only while the request owns no
        block. Returns the block ids appended to the table (hit blocks, then new blocks), or
        None, changing nothing, when too few blocks are free.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        state = self._requests.get(request.request_id)
        if state is not None and self.sliding_window is not None:
            self._skip_out_of_window(request, state, self.sliding_window)
        if state is not None and not new_computed_block_ids and not num_new_computed_tokens:
            # Decode hot path: the owned blocks already have room for the new tokens.
            total = request.num_computed_tokens + num_new_tokens
            if total <= len(state.blocks) * self.block_size:
                if self.enable_prefix_caching:
                    num_full = min(total, len(request.token_ids)) // self.block_size
                    if num_full > state.num_cached_blocks:
                        self._cache_full_blocks(request, state, num_full)
                return []
        num_owned = 0 if state is None else len(state.blocks)
        hit_blocks: list[KVBlock] = []
        num_dead_hits = num_evictable_hits = 0
        if new_computed_block_ids or num_new_computed_tokens:  # off the decode hot path
            hit_blocks = self._hit_blocks(state, new_computed_block_ids, num_new_computed_tokens)
            if self.sliding_window is not None:  # hit blocks already out of every window
                dead_tokens = max(0, num_new_computed_tokens - self.sliding_window + 1)
                num_dead_hits = min(len(hit_blocks), dead_tokens // self.block_size)
            # Evictable hits sit in the free queue but are about to be taken by this request.
            num_evictable_hits = sum(1 for b in hit_blocks[num_dead_hits:] if b.ref_cnt == 0)
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = -(-total // self.block_size) - num_owned - len(hit_blocks)
        if num_needed > self.block_pool.num_free_blocks - num_evictable_hits:
            return None
        if state is None:
            state = self._requests[request.request_id] = RequestBlocks()
        added: list[int] = []
        if hit_blocks:
            live_hits = hit_blocks[num_dead_hits:]
            self.block_pool.touch(live_hits)
            self._append(state, [self.block_pool.null_block] * num_dead_hits + live_hits, added)
            state.num_skipped = num_dead_hits
            state.num_cached_blocks = len(hit_blocks)  # they are cached already
        if num_needed > 0:
            self._append(state, self.block_pool.get_new_blocks(num_needed), added)
        if self.enable_prefix_caching:
            # Only tokens already in request.token_ids can be hashed (no lookahead slots).
            num_full = min(total, request.num_tokens) // self.block_size
            if num_full > state.num_cached_blocks:
                self._cache_full_blocks(request, state, num_full)
        return added

    def _hit_blocks(
        self, state: RequestBlocks | None, block_ids: Sequence[int], num_tokens: int
    ) -> list[KVBlock]:
        """Validate a prefix hit from ``get_computed_blocks`` and return its blocks."""
        if not block_ids:
            if num_tokens:
                raise ValueError("num_new_computed_tokens without new_computed_block_ids")
            return []
        if num_tokens != len(block_ids) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_tokens} does not cover {len(block_ids)} blocks"
            )
        if state is None or state.blocks:
            raise ValueError("a prefix hit is only accepted before the request owns blocks")
        blocks = [self.block_pool.blocks[i] for i in block_ids]
        hashes = state.block_hashes
        for i, block in enumerate(blocks):
            # Catches a hit that went stale (evicted) between lookup and allocation.
            if i >= len(hashes) or block.block_hash != hashes[i]:
                raise ValueError(f"stale prefix hit: {block!r} at position {i}")
        return blocks

    def _skip_out_of_window(self, request: Request, state: RequestBlocks, window: int) -> None:
        """Free the leading blocks no query at or after ``num_computed_tokens`` can see.

        The next query sits at position ``num_computed`` or later and sees keys
        ``> num_computed - window``, so block ``j`` (positions ``j*bs .. (j+1)*bs - 1``) is
        dead once ``(j+1) * bs <= num_computed - window + 1``.
        """
        num_dead = max(0, request.num_computed_tokens - window + 1) // self.block_size
        num_dead = min(num_dead, len(state.blocks))
        if num_dead <= state.num_skipped:
            return
        null = self.block_pool.null_block
        dead = state.blocks[state.num_skipped : num_dead]
        for j in range(state.num_skipped, num_dead):
            state.blocks[j] = null
            state.block_ids[j] = null.block_id
        state.num_skipped = num_dead
        self.block_pool.free_blocks(reversed(dead))

    @staticmethod
    def _append(state: RequestBlocks, blocks: list[KVBlock], added: list[int]) -> None:
        for block in blocks:
            state.blocks.append(block)
            state.block_ids.append(block.block_id)
            added.append(block.block_id)

    def _cache_full_blocks(self, request: Request, state: RequestBlocks, num_full: int) -> None:
        hashes = extend_block_hashes(
            state.block_hashes, request, num_full, self.block_size, self._pack_block
        )
        cache_full_block = self.block_pool.cache_full_block
        # A block skipped before it could be hashed (its tokens arrived late, e.g. accepted
        # speculative tokens) is simply never cached.
        start = max(state.num_cached_blocks, state.num_skipped)
        if self.kv_events is None:
            for i in range(start, num_full):
                cache_full_block(state.blocks[i], hashes[i])
        else:
            stored = [
                i for i in range(start, num_full) if cache_full_block(state.blocks[i], hashes[i])
            ]
            self.record_stored(request, hashes, stored)
        state.num_cached_blocks = num_full

    def record_stored(self, request: Request, hashes: Sequence[bytes], stored: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive newly cached blocks (``stored``: their
        indices in ``request``'s table; ``hashes``: its chain up to them at least)."""
        assert self.kv_events is not None
        bs = self.block_size
        lora = request.lora_request
        lora_key = None if lora is None else (lora.lora_int_id, lora.lora_name)
        run_start = 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k] == stored[k - 1] + 1:
                continue
            first, last = stored[run_start], stored[k - 1]
            self.kv_events.stored(
                list(hashes[first : last + 1]),
                hashes[first - 1] if first > 0 else None,
                list(request.token_ids[first * bs : (last + 1) * bs]),
                lora_key,
                [block_extra_pieces(request, i, bs) for i in range(first, last + 1)],
            )
            run_start = k

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, and forget it. Idempotent."""
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            # Tail blocks are the least likely to be shared, so they are evicted first.
            self.block_pool.free_blocks(reversed(state.owned()))

    # ------------------------------------------------------------------ held tables (sessions)
    def hold(self, request: Request, holder_id: str) -> None:
        """Keep a finishing request's blocks referenced under ``holder_id`` (a session).

        The blocks stay owned (not evictable) so the holder's next request gets a prefix hit
        on everything that was computed. A previous table of the same holder is released
        (after the move, so blocks shared by both keep their reference).
        """
        state = self._requests.pop(request.request_id, None)
        previous = self._held.pop(holder_id, None)
        if state is not None:
            self._held[holder_id] = state
        if previous is not None:
            self.block_pool.free_blocks(reversed(previous.owned()))

    def release(self, holder_id: str) -> bool:
        """Drop a held table; its blocks become free (and stay cached, evictable)."""
        state = self._held.pop(holder_id, None)
        if state is None:
            return False
        self.block_pool.free_blocks(reversed(state.owned()))
        return True

    def held_cached(self, holder_id: str) -> list[tuple[KVBlock, bytes]]:
        """KV tiers: the leading blocks of a held table that carry a prefix hash, with it
        (a block computed twice holds the same KV as the cached one: same hash)."""
        state = self._held.get(holder_id)
        if state is None or state.num_skipped:
            return []
        return list(zip(state.blocks, state.block_hashes[: state.num_cached_blocks], strict=False))

    def oldest_holder(self) -> str | None:
        """The least recently held table (dict order is hold order)."""
        return next(iter(self._held), None)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(state.owned()) for state in self._held.values())

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes; refused (False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self, idle: bool = False) -> None:
        """Raise AssertionError unless tables, ref counts, free queue and hash map agree.

        With ``idle``: additionally no request is known and every block is free (possibly
        cached and evictable).
        """
        tables = [*self._requests.items(), *(("held:" + h, st) for h, st in self._held.items())]
        ref_cnts = check_tables(tables, self.block_pool.null_block.block_id)
        if self.external_refs is not None:  # KV tiers: the connector's references
            for block_id, count in self.external_refs().items():
                ref_cnts[block_id] = ref_cnts.get(block_id, 0) + count
        self.block_pool.check_invariants(ref_cnts)
        if idle:
            check(not self._requests, f"idle but requests remain: {sorted(self._requests)}")
            check(not self._held, f"idle but tables are held: {sorted(self._held)}")
            check(
                self.block_pool.num_free_blocks == self.num_blocks,
                f"idle but only {self.block_pool.num_free_blocks}/{self.num_blocks} blocks free",
            )
