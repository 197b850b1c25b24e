"""The host KV tier (``--kv-offloading-size``, docs/kv-tiers.md): a prefix evicted from a
small device cache comes back from the host tier with the same greedy tokens and logprobs as a
run that never evicted, and reports its cached tokens; the scheduler-side connector (real
scheduler, block manager and connector; loads acknowledged by hand through the plain-data
seam) keeps other requests running while a load is in flight, and an abort during a load frees
everything once the copy is acknowledged; off by default changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from engine_checks import assert_llm_idle

from tokenwire.runtime.config import SchedulerConfig
from tokenwire.runtime.core.block_pool import KVBlock
from tokenwire.runtime.core.kv_cache_manager import KVCacheManager
from tokenwire.runtime.core.kv_connector import OffloadingConnector
from tokenwire.runtime.core.kv_tier_setup import attach_offloading
from tokenwire.runtime.core.request import Request, RequestStatus
from tokenwire.runtime.core.scheduler import Scheduler
from tokenwire.runtime.engine.core_loop import snapshot
from tokenwire.runtime.engine_args import EngineArgs
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.outputs import RequestOutput
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.scheduler_output import SchedulerOutput
from tokenwire.runtime.stats import StepRecorder

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
A = [(i * 7 + 3) % 400 + 3 for i in range(30)]  # 7 full blocks of 4 can hit
B = [(i * 11 + 5) % 400 + 3 for i in range(30)]
C = [(i * 13 + 9) % 400 + 3 for i in range(30)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


def small_llm(model_dir: Path, offload: float | None) -> LLM:
    # 16 usable blocks of 4 tokens: two 36-token sequences do not fit together.
    return LLM(
        str(model_dir),
        device="cpu",
        max_model_len=64,
        block_size=4,
        num_gpu_blocks_override=17,
        kv_offloading_size=offload,
        observer=StepRecorder(),
    )


def one(llm: LLM, prompt: list[int]) -> RequestOutput:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


def assert_same_choice(got: RequestOutput, want: RequestOutput) -> None:
    g, w = got.outputs[0], want.outputs[0]
    assert g.token_ids == w.token_ids
    assert g.logprobs is not None and w.logprobs is not None
    for gp, wp in zip(g.logprobs, w.logprobs, strict=True):
        assert list(gp) == list(wp)
        for token, lp in wp.items():
            assert abs(gp[token].logprob - lp.logprob) < 1e-5


def assert_tier_idle(llm: LLM) -> None:
    assert_llm_idle(llm)
    connector = llm.engine.scheduler.connector
    assert isinstance(connector, OffloadingConnector)
    connector.check_invariants(idle=True)


def test_prefix_restored_from_host_tier_matches_a_run_that_never_evicted(
    model_dir: Path,
) -> None:
    never_evicted = one(small_llm(model_dir, None), A)
    llm = small_llm(model_dir, 0.01)
    first = one(llm, A)
    one(llm, B)
    one(llm, C)  # A's blocks are evicted from the device (saved to the host tier)
    connector = llm.engine.scheduler.connector
    assert isinstance(connector, OffloadingConnector)
    kv = llm.engine.kv_cache_manager
    assert connector.stats().blocks_saved >= 7
    assert all(kv.block_pool.get_cached_block(h) is None for h in connector_hashes(llm, A))
    hits_before = kv.prefix_cache_hits
    again = one(llm, A)
    assert again.num_cached_tokens == 28  # every full block before the last token
    assert kv.prefix_cache_hits - hits_before == 28
    stats = connector.stats()
    assert stats.blocks_loaded == 7 and stats.bytes_loaded == 7 * connector.block_bytes
    assert stats.loads_in_flight == 0 and 0 < stats.used_blocks <= stats.capacity_blocks
    assert_same_choice(first, never_evicted)
    assert_same_choice(again, never_evicted)
    assert_tier_idle(llm)
    recorder = llm.engine.observer
    assert isinstance(recorder, StepRecorder)
    *earlier, last = recorder.requests  # what the request's span reports (docs/observability)
    assert last.num_tier_loaded_tokens == 28 and last.tier_load_time > 0
    assert all(r.num_tier_loaded_tokens == 0 and r.tier_load_time == 0 for r in earlier)
    assert snapshot(llm.engine, 0).kv_offload == connector.stats()  # what metrics read


def connector_hashes(llm: LLM, prompt: list[int]) -> list[bytes]:
    """The chained hashes of ``prompt``'s full blocks, as the block manager computes them."""
    kv = llm.engine.kv_cache_manager
    probe = Request("probe", prompt, GREEDY, frozenset(), 64)
    kv.get_computed_blocks(probe)
    hashes = list(kv.get_block_hashes("probe"))
    kv.free(probe)
    return hashes


def test_off_by_default_changes_nothing(model_dir: Path) -> None:
    assert EngineArgs().create_engine_config().cache.kv_offloading_size is None
    llm = small_llm(model_dir, None)
    assert llm.engine.scheduler.connector is None
    assert llm.engine.kv_cache_manager.block_pool.on_evict is None
    assert snapshot(llm.engine, 0).kv_offload is None
    outs = [one(llm, p) for p in (A, B, C, A)]
    assert outs[3].num_cached_tokens == 0  # evicted, recomputed
    assert_same_choice(outs[3], outs[0])
    assert_llm_idle(llm)


def test_flag_is_validated_and_named() -> None:
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        EngineArgs(kv_offloading_size=-1.0).create_engine_config()
    draft = {"method": "draft_model", "model": "/draft", "num_speculative_tokens": 2}
    # Accepted: the target's KV moves, the draft's is never read stale
    # (tests/runtime/test_kv_tier_draft.py); tensor parallel: each rank moves its own shard.
    with_draft = EngineArgs(kv_offloading_size=2.0, speculative_config=draft)
    assert with_draft.create_engine_config().cache.kv_offloading_size == 2.0
    with_tp = EngineArgs(kv_offloading_size=2.0, tensor_parallel_size=2)
    assert with_tp.create_engine_config().parallel.tensor_parallel_size == 2
    assert EngineArgs(kv_offloading_size=0.5).create_engine_config().cache.kv_offloading_size == 0.5


# ---------------------------------------------------------------------- scheduler side
BLOCK = 4


def make_scheduler(num_blocks: int = 13) -> tuple[Scheduler, KVCacheManager, OffloadingConnector]:
    kv = KVCacheManager(num_blocks, BLOCK, True)
    connector = attach_offloading(kv, num_slots=64, block_bytes=1)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    return Scheduler(config, kv, 256, connector=connector), kv, connector


def request(rid: str, prompt: list[int], max_tokens: int = 1) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, prompt, params, frozenset(), 256)


def step(sched: Scheduler, ack: bool = True) -> SchedulerOutput:
    """One step with a fake model; ``ack``: the worker reports this step's loads finished."""
    so = sched.schedule()
    ids, tokens = [], []
    for rid, n in so.num_scheduled_tokens.items():
        req = sched.requests[rid]
        if req.num_computed_tokens + n == req.num_tokens:
            ids.append(rid)
            tokens.append(7)
    done = [x.load_id for x in so.kv_transfers.loads] if ack and so.kv_transfers else []
    sched.update(so, ModelOutput(req_ids=ids, sampled_token_ids=tokens, kv_loads_done=done))
    sched.kv.check_invariants()
    assert sched.connector is not None
    sched.connector.check_invariants()
    return so


def run_until_idle(sched: Scheduler) -> None:
    for _ in range(100):
        if not sched.has_unfinished_requests():
            return
        step(sched)
    raise AssertionError("the scheduler never went idle")


def evict_prompt_a(sched: Scheduler) -> list[SchedulerOutput]:
    """Run A (4 full blocks) to the end, then B, whose 12 blocks evict all of A's."""
    sched.add_request(request("a", list(range(10, 27))))
    run_until_idle(sched)
    sched.add_request(request("b", list(range(100, 148))))
    outs = [step(sched)]
    run_until_idle(sched)
    return outs


def test_abort_during_a_pending_load_frees_everything_after_the_ack() -> None:
    sched, kv, connector = make_scheduler()
    (b_step,) = evict_prompt_a(sched)
    assert b_step.kv_transfers is not None and len(b_step.kv_transfers.save_block_ids) == 4
    sched.add_request(request("a2", list(range(10, 27))))
    sched.add_request(request("c", list(range(200, 208)), max_tokens=3))
    so = step(sched, ack=False)
    assert so.kv_transfers is not None and len(so.kv_transfers.loads) == 1
    load = so.kv_transfers.loads[0]
    assert len(load.block_ids) == 4
    assert "a2" not in so.num_scheduled_tokens and "c" in so.num_scheduled_tokens
    # The blocks being written are not in the prefix cache yet: nothing can read them.
    assert all(kv.block_pool.blocks[i].block_hash is None for i in load.block_ids)
    so = step(sched, ack=False)  # still loading: a2 waits, c keeps decoding
    assert "a2" not in so.num_scheduled_tokens and "c" in so.num_scheduled_tokens
    assert so.kv_transfers is not None and so.kv_transfers.num_loads_in_flight == 1
    sched.abort_requests(["a2"])
    assert sched.has_unfinished_requests()  # the copy is still landing in its blocks
    assert all(kv.block_pool.blocks[i].ref_cnt == 1 for i in load.block_ids)
    while sched.requests:  # c finishes; the load is not acknowledged yet
        step(sched, ack=False)
    so = sched.schedule()
    assert so.is_empty and so.kv_transfers is not None
    sched.update(so, ModelOutput(req_ids=[], sampled_token_ids=[], kv_loads_done=[load.load_id]))
    assert not sched.has_unfinished_requests()
    kv.check_invariants(idle=True)
    connector.check_invariants(idle=True)
    assert sched.schedule().kv_transfers is None  # nothing left to move


def test_waiting_request_is_admitted_with_the_loaded_blocks_after_the_ack() -> None:
    sched, kv, connector = make_scheduler()
    evict_prompt_a(sched)
    a2 = request("a2", list(range(10, 27)))
    sched.add_request(a2)
    so = step(sched, ack=False)
    assert so.kv_transfers is not None and so.kv_transfers.loads
    assert a2.status == RequestStatus.WAITING and connector.waiting_for_load("a2")
    load_id = so.kv_transfers.loads[0].load_id
    so = sched.schedule()
    sched.update(so, ModelOutput(req_ids=[], sampled_token_ids=[], kv_loads_done=[load_id]))
    so = step(sched)
    assert so.num_scheduled_tokens == {"a2": 1}  # only the last prompt token is computed
    assert a2.num_cached_tokens == 16
    run_until_idle(sched)
    kv.check_invariants(idle=True)
    connector.check_invariants(idle=True)
    assert connector.stats().blocks_loaded == 4


def test_host_tier_evicts_least_recently_used_and_never_a_pinned_slot() -> None:
    from tokenwire.runtime.core.host_tier import HostTier

    tier = HostTier(2)
    assert tier.put(b"x") == 0 and tier.put(b"y") == 1
    assert tier.put(b"x") is None  # already held: now most recently used
    assert tier.put(b"z") == 1  # y was the least recently used
    assert b"y" not in tier and tier.lookup_run([b"x", b"y"]) == [0]
    tier.pin([0, 1])
    assert tier.put(b"w") is None  # every slot is being read by a load
    tier.unpin([0, 1])
    assert tier.put(b"w") == 1  # z: x was touched by the lookup
    tier.check_invariants(idle=True)
    # A Session moving down needs a slot per hash not here, free or unpinned, other than its own.
    assert tier.can_take([b"x", b"w"]) and tier.can_take([b"x", b"v"])
    assert not tier.can_take([b"x", b"v", b"u"])
    tier.pin([0])
    assert not tier.can_take([b"v", b"u"]) and tier.can_take([b"x", b"v"])
    tier.unpin([0])


def test_host_hits_keep_the_cache_salt_isolation() -> None:
    sched, kv, connector = make_scheduler()
    a = request("a", list(range(10, 27)))
    a.cache_salt = "tenant-x"
    sched.add_request(a)
    run_until_idle(sched)
    sched.add_request(request("b", list(range(100, 148))))  # evicts a's blocks to the host
    run_until_idle(sched)
    other = request("other", list(range(10, 27)))
    other.cache_salt = "tenant-y"
    sched.add_request(other)
    so = step(sched)
    assert so.kv_transfers is None or not so.kv_transfers.loads  # another salt: no host hit
    assert so.num_scheduled_tokens == {"other": 17}
    run_until_idle(sched)
    same = request("same", list(range(10, 27)))
    same.cache_salt = "tenant-x"
    sched.add_request(same)
    so = step(sched)
    assert so.kv_transfers is not None and len(so.kv_transfers.loads[0].block_ids) == 4
    run_until_idle(sched)
    assert same.num_cached_tokens == 16
    kv.check_invariants(idle=True)
    connector.check_invariants(idle=True)


def test_fp8_kv_cache_blocks_come_back_byte_exact(model_dir: Path) -> None:
    def fp8_llm(offload: float | None) -> LLM:
        return LLM(
            str(model_dir),
            device="cpu",
            max_model_len=64,
            block_size=4,
            num_gpu_blocks_override=17,
            kv_cache_dtype="fp8",
            kv_offloading_size=offload,
        )

    never_evicted = one(fp8_llm(None), A)
    llm = fp8_llm(0.01)
    for prompt in (A, B, C):
        one(llm, prompt)
    again = one(llm, A)
    assert again.num_cached_tokens == 28
    assert_same_choice(again, never_evicted)
    assert_tier_idle(llm)


def test_a_session_turn_makes_room_for_its_load_by_moving_other_sessions_down() -> None:
    """Three Sessions over 12 device blocks, all of them holdable: the third moves the first
    down to the host tier; the first's next turn, whose full blocks are partly on the device and
    partly on the host, moves the second down before its load (not after a cut-short load), so
    it reports every full block of its transcript as cached; no Session is evicted."""
    kv = KVCacheManager(13, BLOCK, True)
    connector = attach_offloading(kv, num_slots=64, block_bytes=1)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    sched = Scheduler(config, kv, 256, max_held_blocks=12, connector=connector)
    prompts = {s: [(i * 7 + 31 * n) % 400 + 3 for i in range(17)] for n, s in enumerate("abc")}
    for s, prompt in prompts.items():
        turn = request(f"{s}/0", prompt)
        turn.hold_as = s
        sched.add_request(turn)
        run_until_idle(sched)
    assert connector.stats().session_blocks == 4  # a's 4 full blocks moved down
    again = request("a/1", [*prompts["a"], 7, 50, 51])
    again.hold_as = "a"
    sched.add_request(again)
    run_until_idle(sched)
    assert again.num_cached_tokens == 16
    assert sched.pop_evicted_holders() == []
    assert connector.stats().session_blocks >= 4  # the others moved down; a is on the device
    for s in "abc":
        sched.release_holder(s)
    kv.check_invariants(idle=True)
    connector.check_invariants(idle=True)


def test_sessions_pin_at_most_their_share_of_the_host_tier() -> None:
    """``session_cache_fraction`` bounds the host slots Sessions pin (here 4 of 8): a Session
    that would pass it is refused (CONTEXT_EVICTED) though slots are free, a prefix two
    Sessions share counts once, and prefix blocks can still be saved past the Sessions."""
    kv = KVCacheManager(16, BLOCK, True)
    connector = attach_offloading(kv, num_slots=8, block_bytes=1, session_fraction=0.5)
    assert connector.sessions.max_host_slots == 4
    blocks = kv.block_pool.blocks

    def table(*ids: int) -> list[tuple[KVBlock, bytes]]:
        return [(blocks[i], f"h{i}".encode()) for i in ids]

    assert connector.hold_session("s1", table(1, 2, 3))
    assert not connector.hold_session("s2", table(4, 5))  # 5 slots > 4: refused
    assert connector.hold_session("s3", table(1, 4))  # shares h1: 4 slots in all
    assert connector.stats().session_blocks == 5  # two Sessions hold h1's slot
    assert not connector.hold_session("s4", table(6))
    connector.build_plan()  # the saves ride in a step; nothing else is pinned now
    for i in (6, 7, 8, 9):  # ordinary prefix saves still find room beside them
        connector.on_evict(cached(blocks[i], f"p{i}".encode()))
    assert connector.unhold_session("s1")
    assert connector.hold_session("s2", table(4, 5))  # h1 is s3's alone now: 3 slots
    for holder in ("s2", "s3"):
        connector.unhold_session(holder)
    connector.build_plan()
    connector.check_invariants(idle=True)


def cached(block: KVBlock, block_hash: bytes) -> KVBlock:
    block.block_hash = block_hash
    return block


def test_a_session_moved_down_holds_every_block_of_its_table() -> None:
    """A full host tier whose least recently used entry is one of the Session's own blocks:
    the move evicts other entries, never that one, and every block of the table ends in a
    slot pinned for the Session."""
    kv = KVCacheManager(16, BLOCK, True)
    connector = attach_offloading(kv, num_slots=3, block_bytes=1, session_fraction=1.0)
    blocks = kv.block_pool.blocks
    for i, name in ((7, b"own"), (8, b"x1"), (9, b"x2")):  # "own" least recently used
        connector.on_evict(cached(blocks[i], name))
    connector.build_plan()
    table = [(blocks[1], b"new"), (blocks[7], b"own")]
    assert connector.hold_session("s", table)
    slots = {connector.tier.peek(h) for _, h in table}
    assert None not in slots and len(slots) == 2
    assert not connector.tier.can_take([b"a", b"b"])  # both Session slots are pinned
    connector.unhold_session("s")
    connector.build_plan()
    connector.check_invariants(idle=True)
