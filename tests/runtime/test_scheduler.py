"""Scheduler + block manager with a fake executor: budget rules, chunked prefill, preemption,
abort, priority, and property-based invariants. No torch, no model."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenwire.runtime.config import SchedulerConfig
from tokenwire.runtime.core.kv_cache_manager import KVCacheManager
from tokenwire.runtime.core.request import Request, RequestStatus
from tokenwire.runtime.core.scheduler import Scheduler
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.outputs import FinishReason
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.scheduler_output import SchedulerOutput

EOS = 2
BLOCK = 4


class FakeExecutor:
    """Samples a deterministic token for every request brought up to date this step."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.known: set[str] = set()

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        self.known -= so.finished_req_ids
        for new in so.new_reqs:
            assert new.request_id not in self.known, "new request sent twice"
            self.known.add(new.request_id)
        for rid in so.cached_reqs.request_ids:
            assert rid in self.known, "diff for a request the executor never saw"
        req_ids, tokens = [], []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            if req.num_computed_tokens + n == req.num_tokens:
                req_ids.append(rid)
                tokens.append(100 + (req.num_tokens * 7 + len(rid)) % 50)  # never EOS
        return ModelOutput(req_ids=req_ids, sampled_token_ids=tokens)


def make(
    num_blocks: int = 64,
    budget: int = 32,
    max_seqs: int = 8,
    policy: str = "fcfs",
    caching: bool = True,
    max_model_len: int = 256,
) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks, BLOCK, caching)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            scheduling_policy=policy,  # type: ignore[arg-type]
        ),
        kv,
        max_model_len,
    )
    return sched, kv


def request(
    rid: str,
    prompt_len: int,
    max_tokens: int,
    priority: int = 0,
    arrival: float = 0.0,
    first: int = 10,
) -> Request:
    prompt = [first + (i % 13) for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(
        rid, prompt, params, frozenset({EOS}), 256, arrival_time=arrival, priority=priority
    )


def run(
    sched: Scheduler, executor: FakeExecutor, max_steps: int = 10_000, on_step: object = None
) -> list[SchedulerOutput]:
    outputs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        cfg = sched.config
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        sched.update(so, executor.execute(so))
        sched.kv.check_invariants(idle=False)
        outputs.append(so)
    assert not sched.has_unfinished_requests(), "did not finish"
    return outputs


def test_decode_and_chunked_prefill_respect_budget() -> None:
    sched, kv = make(budget=16)
    reqs = [request("long", 40, 3), request("short", 5, 4)]
    for r in reqs:
        sched.add_request(r)
    steps = run(sched, FakeExecutor(sched))
    # The 40-token prompt needs three chunks (16 + 16 + 8); the short one rides along.
    assert [so.num_scheduled_tokens.get("long") for so in steps[:3]] == [16, 16, 8]
    assert all(r.finish_reason == FinishReason.LENGTH for r in reqs)
    assert [r.num_output_tokens for r in reqs] == [3, 4]
    kv.check_invariants(idle=True)
    assert kv.num_free_blocks == kv.num_blocks


def test_no_chunked_prefill_waits_for_whole_prompt() -> None:
    kv = KVCacheManager(64, BLOCK, True)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched = Scheduler(cfg, kv, 256)
    sched.add_request(request("a", 10, 2))
    sched.add_request(request("b", 10, 2, first=30))  # different prompt: no prefix hit
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 10}  # b does not fit the remaining 6 tokens


def test_preemption_by_recompute_then_everything_finishes() -> None:
    # 6 usable blocks of 4 tokens = 24 slots; three requests growing to 14 tokens each.
    sched, kv = make(num_blocks=7, budget=64)
    reqs = [request(f"r{i}", 6, 8, arrival=float(i)) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    steps = run(sched, FakeExecutor(sched))
    preempted = set().union(*(so.preempted_req_ids for so in steps))
    assert "r2" in preempted  # the latest arrival is the victim
    assert sched.num_preemptions_total >= 1
    assert all(r.num_output_tokens == 8 for r in reqs)
    kv.check_invariants(idle=True)


def test_preempted_request_is_resumed_with_full_block_list() -> None:
    sched, kv = make(num_blocks=5, budget=64)
    a, b = request("a", 7, 6, arrival=0.0), request("b", 7, 6, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    executor = FakeExecutor(sched)
    resumed_seen = False
    while sched.has_unfinished_requests():
        so = sched.schedule()
        for rid, resumed, blocks in zip(
            so.cached_reqs.request_ids,
            so.cached_reqs.resumed_from_preemption,
            so.cached_reqs.new_block_ids,
            strict=True,
        ):
            if resumed:
                resumed_seen = True
                assert blocks == kv.get_block_ids(rid)
        sched.update(so, executor.execute(so))
    assert resumed_seen
    kv.check_invariants(idle=True)


@pytest.mark.parametrize("where", ["waiting", "running"])
def test_abort_anywhere_frees_blocks(where: str) -> None:
    sched, kv = make(max_seqs=1)
    sched.add_request(request("a", 8, 50))
    sched.add_request(request("b", 8, 50))
    executor = FakeExecutor(sched)
    for _ in range(3):
        sched.update(so := sched.schedule(), executor.execute(so))
    victim = "b" if where == "waiting" else "a"
    assert sched.requests[victim].status == (
        RequestStatus.WAITING if where == "waiting" else RequestStatus.RUNNING
    )
    aborted = sched.abort_requests([victim])
    assert [r.request_id for r in aborted] == [victim]
    assert aborted[0].finish_reason == FinishReason.CANCELLED
    assert sched.abort_requests([victim]) == []  # idempotent
    so = sched.schedule()
    assert victim in so.finished_req_ids and victim not in so.num_scheduled_tokens
    sched.abort_requests(list(sched.requests))
    kv.check_invariants(idle=True)


def test_priority_policy_orders_admission_and_picks_victim() -> None:
    sched, kv = make(num_blocks=6, budget=64, policy="priority", max_seqs=8)
    low = request("low", 6, 10, priority=5, arrival=0.0)
    high = request("high", 6, 10, priority=0, arrival=1.0)
    sched.add_request(low)
    sched.add_request(high)
    so = sched.schedule()
    assert next(iter(so.num_scheduled_tokens)) == "high"
    executor = FakeExecutor(sched)
    sched.update(so, executor.execute(so))
    steps = run(sched, executor)
    preempted = set().union(*(s.preempted_req_ids for s in steps))
    assert preempted <= {"low"} and preempted  # the low-priority request pays
    kv.check_invariants(idle=True)


def test_eos_and_stop_token_and_context_length() -> None:
    sched, kv = make(max_model_len=12)
    r_eos = Request("eos", [5, 6, 7], SamplingParams(max_tokens=5), frozenset({EOS}), 12)
    r_stop = Request(
        "stop", [5, 6, 7], SamplingParams(max_tokens=5, stop_token_ids=[9]), frozenset({EOS}), 12
    )
    r_ctx = Request("ctx", [5] * 8, SamplingParams(max_tokens=None), frozenset({EOS}), 12)
    r_min = Request(
        "min", [5, 6, 7], SamplingParams(max_tokens=5, min_tokens=3), frozenset({EOS}), 12
    )
    for r in (r_eos, r_stop, r_ctx, r_min):
        sched.add_request(r)
    scripted = {"eos": [3, EOS], "stop": [9], "ctx": [4, 4, 4, 4], "min": [EOS, EOS, EOS]}
    while sched.has_unfinished_requests():
        so = sched.schedule()
        ids = [rid for rid in so.num_scheduled_tokens]
        toks = [scripted[rid][sched.requests[rid].num_output_tokens] for rid in ids]
        sched.update(so, ModelOutput(req_ids=ids, sampled_token_ids=toks))
    assert (r_eos.finish_reason, r_eos.output_token_ids) == (FinishReason.EOS, [3, EOS])
    assert (r_stop.finish_reason, r_stop.stop_reason) == (FinishReason.STOP_TOKEN, 9)
    assert r_ctx.finish_reason == FinishReason.CONTEXT_LENGTH and r_ctx.num_tokens == 12
    assert r_min.finish_reason == FinishReason.EOS and r_min.num_output_tokens == 3
    kv.check_invariants(idle=True)


def test_shared_prefix_in_one_step_gets_prefix_hit() -> None:
    sched, kv = make(budget=64)
    a, b = request("a", 13, 2), request("b", 13, 2)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    # b hits the 3 full blocks a registered in this same step; it computes only the rest.
    assert so.num_scheduled_tokens == {"a": 13, "b": 1}
    assert b.num_cached_tokens == 12
    executor = FakeExecutor(sched)
    sched.update(so, executor.execute(so))
    run(sched, executor)
    kv.check_invariants(idle=True)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(12, 40),
    budget=st.integers(4, 48),
    max_seqs=st.integers(1, 6),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    num_requests=st.integers(1, 8),
)
def test_random_workloads_keep_invariants(
    seed: int,
    num_blocks: int,
    budget: int,
    max_seqs: int,
    policy: str,
    caching: bool,
    num_requests: int,
) -> None:
    rng = random.Random(seed)
    sched, kv = make(
        num_blocks=num_blocks,
        budget=budget,
        max_seqs=max_seqs,
        policy=policy,
        caching=caching,
        max_model_len=40,
    )
    reqs = [
        request(
            f"r{i}",
            rng.randint(1, 20),
            rng.randint(1, 12),
            rng.randint(0, 3),
            float(i),
            first=rng.choice([10, 10, 30]),
        )
        for i in range(num_requests)
    ]
    for r in reqs:
        sched.add_request(r)
    executor = FakeExecutor(sched)
    steps = 0
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < 2000, "no progress"
        if rng.random() < 0.05 and sched.requests:
            sched.abort_requests([rng.choice(sorted(sched.requests))])
        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= budget
        assert len(so.num_scheduled_tokens) <= max_seqs
        for rid in so.num_scheduled_tokens:  # every scheduled token has a slot
            req = sched.requests[rid]
            needed = req.num_computed_tokens + so.num_scheduled_tokens[rid]
            assert len(kv.get_block_ids(rid)) * BLOCK >= needed
        sched.update(so, executor.execute(so))
        kv.check_invariants(idle=False)
    for r in reqs:
        assert r.is_finished
        if r.finish_reason == FinishReason.LENGTH:
            assert r.num_output_tokens == r.sampling_params.max_tokens
    kv.check_invariants(idle=True)
    assert kv.num_free_blocks == kv.num_blocks
