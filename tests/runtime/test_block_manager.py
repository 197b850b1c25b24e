"""Block pool and KV-cache manager: counts, prefix hits, LRU eviction, known prefix-cache bugs."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenwire.runtime.core.block_pool import BlockPool
from tokenwire.runtime.core.kv_cache_manager import KVCacheManager
from tokenwire.runtime.core.request import Request
from tokenwire.runtime.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=64)
    return Request(request_id, tokens, params, frozenset(), 4096, cache_salt=cache_salt)


def prefill(kv: KVCacheManager, request: Request) -> list[int]:
    """Schedule the whole prompt at once (with its prefix hit), as the scheduler would."""
    hit_ids, num_hit = kv.get_computed_blocks(request)
    added = kv.allocate_slots(request, request.num_tokens - num_hit, hit_ids, num_hit)
    assert added is not None
    request.num_computed_tokens = request.num_tokens
    return added


def probe(kv: KVCacheManager, tokens: list[int], salt: str | None = None) -> list[int]:
    """Block ids a new request with ``tokens`` would hit (forgets the probe afterwards)."""
    request = make_request("probe", tokens, salt)
    hit_ids, _ = kv.get_computed_blocks(request)
    kv.free(request)
    return hit_ids


def snapshot(kv: KVCacheManager, request_ids: list[str]) -> Any:
    pool = kv.block_pool
    return (
        pool.free_block_ids(),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {rid: list(kv.get_block_ids(rid)) for rid in request_ids},
        kv.prefix_cache_queries,
        kv.prefix_cache_hits,
    )


def test_allocate_and_free_counts() -> None:
    kv = KVCacheManager(num_blocks=11, block_size=4, enable_prefix_caching=True)
    assert (kv.num_blocks, kv.num_free_blocks, kv.num_tokens_capacity) == (10, 10, 40)
    req = make_request("a", list(range(10)))
    added = prefill(kv, req)
    assert len(added) == 3 and 0 not in added
    assert kv.get_block_ids("a") == added
    assert kv.num_free_blocks == 7 and kv.usage == pytest.approx(0.3)
    kv.check_invariants()
    kv.free(req)
    assert kv.num_free_blocks == 10 and kv.usage == 0.0
    kv.check_invariants(idle=True)


def test_prefix_hit_reuses_blocks_and_counts_stats() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=16, enable_prefix_caching=True)
    a = make_request("a", list(range(33)))
    a_ids = prefill(kv, a)
    kv.free(a)
    b = make_request("b", [*range(32), 99, 98])
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert (hit_ids, num_hit) == (a_ids[:2], 32)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (33 + 34, 32)
    added = kv.allocate_slots(b, 2, hit_ids, num_hit)
    assert added is not None and added[:2] == a_ids[:2] and len(added) == 3
    assert [kv.block_pool.blocks[i].ref_cnt for i in added] == [1, 1, 1]
    kv.check_invariants()
    kv.free(b)
    kv.check_invariants(idle=True)


def test_lru_evicts_least_recently_freed_cached_block_and_its_hash() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=True)
    a, b = make_request("a", [1] * 4), make_request("b", [2] * 4)
    (a_block,) = prefill(kv, a)
    kv.free(a)
    (b_block,) = prefill(kv, b)
    kv.free(b)
    assert probe(kv, [1] * 5) == [a_block] and probe(kv, [2] * 5) == [b_block]
    a_hash = kv.block_pool.blocks[a_block].block_hash
    assert a_hash is not None
    # Needs 3 of the 4 free blocks: the two never-used ones, then a's (freed before b's).
    assert a_block in prefill(kv, make_request("c", [3] * 12))
    assert kv.block_pool.get_cached_block(a_hash) is None
    assert probe(kv, [1] * 5) == []
    assert probe(kv, [2] * 5) == [b_block]
    kv.check_invariants()


def test_fully_cached_prompt_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=16, enable_prefix_caching=True)
    prompt = list(range(100, 132))  # 32 tokens: exactly two full blocks
    a_ids = prefill(kv, make_request("a", prompt))
    b = make_request("b", prompt)
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert (hit_ids, num_hit) == (a_ids[:1], 16)
    added = kv.allocate_slots(b, 16, hit_ids, num_hit)
    assert added is not None and added[0] == a_ids[0] and added[1] != a_ids[1]
    c = make_request("c", [*prompt, 7])  # one more token: both blocks may hit
    assert kv.get_computed_blocks(c) == (a_ids[:2], 32)


def test_identical_prompts_in_one_step_share_blocks() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=16, enable_prefix_caching=True)
    prompt = list(range(40))
    a, b = make_request("a", prompt), make_request("b", prompt)
    assert kv.get_computed_blocks(a) == ([], 0)
    a_ids = kv.allocate_slots(a, 40)
    assert a_ids is not None and len(a_ids) == 3
    # Same step: nothing computed or freed yet; b must hit a's blocks cached at allocation.
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert (hit_ids, num_hit) == (a_ids[:2], 32)
    b_ids = kv.allocate_slots(b, 8, hit_ids, num_hit)
    assert b_ids is not None and b_ids[:2] == a_ids[:2] and b_ids[2] != a_ids[2]
    assert [kv.block_pool.blocks[i].ref_cnt for i in b_ids] == [2, 2, 1]
    assert kv.num_free_blocks == 8 - 4
    kv.check_invariants()
    kv.free(a)
    kv.free(b)
    kv.check_invariants(idle=True)


def test_reused_block_keeps_no_stale_hash() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    old = [1, 2, 3, 4, 5]
    a = make_request("a", old)
    a_ids = prefill(kv, a)
    kv.free(a)
    assert probe(kv, old) == a_ids[:1]
    b = make_request("b", [7] * 5)  # needs both usable blocks: a's cached block is reused
    b_ids = prefill(kv, b)
    assert a_ids[0] in b_ids
    assert probe(kv, old) == []
    kv.free(b)
    assert probe(kv, old) == [] and probe(kv, [7] * 5) == b_ids[:1]
    kv.check_invariants(idle=True)


def test_cache_salt_isolates_requests() -> None:
    kv = KVCacheManager(num_blocks=17, block_size=4, enable_prefix_caching=True)
    prompt = list(range(9))
    x_ids = prefill(kv, make_request("x", prompt, cache_salt="x"))
    assert probe(kv, prompt, "x") == x_ids[:2]
    assert probe(kv, prompt, "y") == []
    assert probe(kv, prompt, None) == []
    none_ids = prefill(kv, make_request("n", prompt))
    assert probe(kv, prompt, None) == none_ids[:2]
    assert probe(kv, prompt, "") == []


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    prefill(kv, a)  # 3 blocks, the first two cached
    kv.free(a)
    c = make_request("c", [*range(8), 50, 51, 52, 53, 54, 55, 56, 57, 58])
    hit_ids, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 8 and kv.num_free_blocks == 4
    # 17 tokens = 5 blocks: 2 hit + 3 new. 4 blocks are "free", but 2 of them are the hits.
    before = snapshot(kv, ["a", "c"])
    assert kv.allocate_slots(c, 9, hit_ids, num_hit) is None
    assert snapshot(kv, ["a", "c"]) == before
    kv.check_invariants()
    added = kv.allocate_slots(c, 8, hit_ids, num_hit)  # 16 tokens = 2 hit + 2 new: fits
    assert added is not None and added[:2] == hit_ids and kv.num_free_blocks == 0
    kv.check_invariants()


def test_free_is_idempotent_and_releases_tail_first() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(12)))
    a_ids = prefill(kv, a)
    kv.free(a)
    assert kv.block_pool.free_block_ids()[-3:] == a_ids[::-1]
    kv.free(a)
    kv.free(make_request("never-seen", [1]))
    assert kv.num_free_blocks == 8 and kv.get_block_ids("a") == []
    kv.check_invariants(idle=True)


def test_decode_caches_block_when_it_fills() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=4, enable_prefix_caching=True)
    a = make_request("a", [5, 6, 7, 8, 9, 10, 11])
    a_ids = prefill(kv, a)
    assert len(a_ids) == 2 and probe(kv, [*a.token_ids, 0]) == a_ids[:1]
    a.token_ids.append(12)  # sampled token, appended before scheduling the decode step
    assert kv.allocate_slots(a, 1) == []
    a.num_computed_tokens += 1
    assert probe(kv, [*a.token_ids, 0]) == a_ids
    a.token_ids.append(13)
    new = kv.allocate_slots(a, 1)
    assert new is not None and len(new) == 1 and kv.get_block_ids("a") == a_ids + new
    kv.check_invariants()


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=4, enable_prefix_caching=False)
    prompt = list(range(9))
    prefill(kv, make_request("a", prompt))
    b = make_request("b", prompt)
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.block_pool.num_cached_blocks == 0
    assert kv.prefix_cache_queries == 0
    kv.check_invariants()


def test_reset_prefix_cache_only_when_idle() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    prefill(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert probe(kv, list(range(9))) != []
    assert kv.reset_prefix_cache() is True
    assert probe(kv, list(range(9))) == []
    kv.check_invariants(idle=True)


def test_stale_prefix_hit_is_rejected() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    prefill(kv, a)
    kv.free(a)
    b = make_request("b", [1, 2, 3, 4, 6])
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert len(hit_ids) == 1
    c = make_request("c", [9] * 8)
    prefill(kv, c)  # evicts the hit block before b allocates
    with pytest.raises(ValueError, match="stale prefix hit"):
        kv.allocate_slots(b, 1, hit_ids, num_hit)


def test_check_invariants_detects_corruption() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(5)))
    a_ids = prefill(kv, a)
    block = kv.block_pool.blocks[a_ids[0]]
    block.ref_cnt += 1
    with pytest.raises(AssertionError, match="expected ref_cnt 1"):
        kv.check_invariants()
    block.ref_cnt -= 1
    other = kv.block_pool.blocks[a_ids[1]]
    other.block_hash = block.block_hash  # two blocks claiming one hash
    with pytest.raises(AssertionError, match="stale hash"):
        kv.check_invariants()
    other.block_hash = None
    with pytest.raises(AssertionError, match="idle but requests remain"):
        kv.check_invariants(idle=True)


def test_sliding_window_frees_blocks_behind_every_window() -> None:
    """Window 6, blocks of 4: after 20 computed tokens the next query (position 20) sees keys
    15..20, so blocks 0-2 (positions 0..11) are dead; they are freed but stay cached, and a
    later prefix hit on them takes only the live blocks."""
    kv = KVCacheManager(num_blocks=9, block_size=4, enable_prefix_caching=True, sliding_window=6)
    a = make_request("a", list(range(20)))
    first = prefill(kv, a)
    assert kv.num_free_blocks == 3
    a.token_ids.append(99)
    new = kv.allocate_slots(a, 1)
    assert new is not None and len(new) == 1
    assert kv.get_block_ids("a") == [0, 0, 0, *first[3:], *new]
    assert kv.num_free_blocks == 8 - 6 + 3
    assert kv.num_free_blocks == sum(1 for b in kv.block_pool.blocks[1:] if b.ref_cnt == 0)
    kv.check_invariants()
    b = make_request("b", [*range(20), 7])
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert (hit_ids, num_hit) == (first, 20)  # freed blocks are still cached
    added = kv.allocate_slots(b, 1, hit_ids, num_hit)
    assert added is not None and added[:5] == [0, 0, 0, *first[3:]]
    assert [kv.block_pool.blocks[i].ref_cnt for i in first] == [0, 0, 0, 2, 2]
    kv.check_invariants()
    kv.free(a)
    kv.free(b)
    kv.check_invariants(idle=True)


def test_block_pool_basics() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    assert pool.num_free_blocks == 3 and 0 not in pool.free_block_ids()
    b1, b2 = pool.get_new_blocks(2)
    assert (b1.block_id, b2.block_id, b1.ref_cnt) == (1, 2, 1)
    pool.cache_full_block(b1, b"h")
    pool.cache_full_block(b2, b"h")  # duplicate content: stays uncached
    assert pool.get_cached_block(b"h") is b1 and b2.block_hash is None
    pool.free_blocks([b2, b1])
    assert pool.free_block_ids() == [3, 2, 1]
    pool.touch([b1])  # revive the evictable cached block
    assert b1.ref_cnt == 1 and pool.free_block_ids() == [3, 2]
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)
    pool.free_blocks([b1])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([b1])
    pool.get_new_blocks(3)
    assert b1.block_hash is None and pool.get_cached_block(b"h") is None


# A few shared prefixes over a tiny alphabet so random prompts collide often.
BASES = ([1, 2, 1, 2, 3, 1, 2, 1, 2, 3, 3, 3, 1, 1, 2, 2], [2] * 16)


def chunk_sizes(remaining: int) -> st.SearchStrategy[int]:
    """Chunked-prefill sizes, biased to "all the rest" (the common case, and the tightest fit)."""
    return st.one_of(st.just(remaining), st.integers(1, remaining))


class BlockManagerMachine(RuleBasedStateMachine):
    """Scheduler-like random traffic; a simulated KV cache proves every prefix hit is right."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=2, block_size=1, enable_prefix_caching=False)
        self.running: dict[str, Request] = {}
        self.waiting: dict[str, Request] = {}
        # Simulated KV cache: block id -> token written in each slot (what a forward stores).
        self.content: dict[int, list[int | None]] = {}
        self.count = 0
        self.history: list[Request] = []
        self.window: int | None = None

    @initialize(
        num_blocks=st.integers(2, 24),
        bs=st.sampled_from([1, 2, 4]),
        on=st.booleans(),
        window=st.one_of(st.none(), st.integers(1, 6)),
    )
    def setup(self, num_blocks: int, bs: int, on: bool, window: int | None) -> None:
        """``window``: every layer attends within it, so blocks behind it are freed."""
        self.kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=on, sliding_window=window)
        self.window = window
        self.content = {i: [None] * bs for i in range(num_blocks)}

    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(0, 16),
        tail=st.lists(st.integers(0, 3), max_size=8),
    )
    def add(self, base: list[int], cut: int, tail: list[int]) -> None:
        self.enqueue(base[:cut] + tail or [0], "s" if cut == 7 else None)

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def add_follow_up(self, data: st.DataObject) -> None:
        """Resend (a prefix of) an earlier transcript, outputs included, as a multi-turn chat."""
        old = data.draw(st.sampled_from(self.history))
        self.enqueue(old.token_ids[: data.draw(st.integers(1, old.num_tokens))], old.cache_salt)

    def enqueue(self, prompt: list[int], salt: str | None) -> None:
        self.count += 1
        req = make_request(f"r{self.count}", prompt[:40], cache_salt=salt)
        self.waiting[req.request_id] = req
        self.history.append(req)

    @rule(data=st.data())
    def engine_step(self, data: st.DataObject) -> None:
        """Running requests first (next chunk or one decode token), then admit waiting ones."""
        for req in list(self.running.values()):
            start = req.num_computed_tokens
            if start == req.num_tokens:  # decode: the sampled token is appended first
                req.token_ids.append(data.draw(st.integers(0, 3)))
            chunk = data.draw(chunk_sizes(req.num_tokens - start))
            if self.kv.allocate_slots(req, chunk) is None:
                self.release(req, preempt=True)
            else:
                self.forward(req, start, start + chunk)
        for req in list(self.waiting.values()):
            if not self.admit(req, data):
                break

    def admit(self, req: Request, data: st.DataObject) -> bool:
        hit_ids, num_hit = self.kv.get_computed_blocks(req)
        bs = self.kv.block_size
        assert num_hit == len(hit_ids) * bs < req.num_tokens
        for i, block_id in enumerate(hit_ids):
            assert self.content[block_id] == req.token_ids[i * bs : i * bs + bs], "wrong KV hit"
        chunk = data.draw(chunk_sizes(req.num_tokens - num_hit))
        ids = sorted(self.running) + sorted(self.waiting)
        before = snapshot(self.kv, ids)
        added = self.kv.allocate_slots(req, chunk, hit_ids, num_hit)
        if added is None:
            assert snapshot(self.kv, ids) == before, "failed allocation changed state"
            return False
        assert added == self.kv.get_block_ids(req.request_id)
        # Hit blocks already behind the window come back as the null block (never taken).
        assert all(a in (h, 0) for a, h in zip(added, hit_ids, strict=False))
        assert 0 not in added or self.window is not None
        self.running[req.request_id] = self.waiting.pop(req.request_id)
        self.forward(req, num_hit, num_hit + chunk)
        return True

    def forward(self, req: Request, start: int, end: int) -> None:
        bs, table = self.kv.block_size, self.kv.get_block_ids(req.request_id)
        for pos in range(start, end):
            block_id = table[pos // bs]
            assert self.kv.block_pool.blocks[block_id].ref_cnt == 1, "write to a shared block"
            self.content[block_id][pos % bs] = req.token_ids[pos]
        for pos in range(start, end):  # every key a query attends to is live and right
            first = 0 if self.window is None else max(0, pos - self.window + 1)
            for key in range(first, pos + 1):
                block_id = table[key // bs]
                assert block_id != 0, f"key {key} of query {pos} was freed"
                assert self.content[block_id][key % bs] == req.token_ids[key], "wrong KV read"
        req.num_computed_tokens = end

    def release(self, req: Request, preempt: bool) -> None:
        self.kv.free(req)
        self.running.pop(req.request_id, None)
        self.waiting.pop(req.request_id, None)
        if preempt:  # recompute: back to waiting with nothing computed
            req.num_computed_tokens = 0
            self.waiting[req.request_id] = req

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data(), preempt=st.booleans(), twice=st.booleans())
    def finish_abort_or_preempt(self, data: st.DataObject, preempt: bool, twice: bool) -> None:
        req = data.draw(st.sampled_from([*self.running.values(), *self.waiting.values()]))
        self.release(req, preempt)
        if twice:
            self.kv.free(req)

    @rule()
    def reset_prefix_cache(self) -> None:
        idle = self.kv.num_free_blocks == self.kv.num_blocks
        assert self.kv.reset_prefix_cache() is idle

    @invariant()
    def consistent(self) -> None:
        self.kv.check_invariants()
        used = {b for rid in self.running for b in self.kv.get_block_ids(rid) if b != 0}
        assert self.kv.num_free_blocks + len(used) == self.kv.num_blocks

    def teardown(self) -> None:
        for req in [*self.running.values(), *self.waiting.values()]:
            self.kv.free(req)
        self.kv.check_invariants(idle=True)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
