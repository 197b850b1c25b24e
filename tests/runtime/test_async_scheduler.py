"""The scheduler under async scheduling (one step in flight, placeholders), with a fake worker
that, like the real runner, keeps its own token counts and samples a token that depends only
on the request and its position: every request ends with the same tokens as under
synchronous steps, through preemption (also of a request whose step is in flight), EOS,
max_tokens and aborts, and the block manager's invariants hold throughout. No torch."""

from __future__ import annotations

import random

import pytest

from tokenwire.runtime.config import SchedulerConfig
from tokenwire.runtime.core.kv_cache_manager import KVCacheManager
from tokenwire.runtime.core.request import Request
from tokenwire.runtime.core.scheduler import Scheduler
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.outputs import EngineCoreOutput, FinishReason
from tokenwire.runtime.sampling_params import SamplingParams, embedding_params
from tokenwire.runtime.scheduler_output import SchedulerOutput

EOS = 2
BLOCK = 4


def token_at(request_id: str, position: int) -> int:
    """The fake model's token: EOS now and then, else a function of (request, position)."""
    h = (sum(map(ord, request_id)) * 31 + position * 17) % 97
    return EOS if h == 5 else 100 + h


class FakeWorker:
    """Its own per-request (num_tokens, num_computed), as the runner's rows: a step samples
    for a row it brings up to date, whatever the scheduler knows at that time."""

    def __init__(self) -> None:
        self.rows: dict[str, list[int]] = {}
        self.pooling: set[str] = set()  # embedding requests: pool once the prompt is computed

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        for rid in so.finished_req_ids:
            self.rows.pop(rid, None)
        for new in so.new_reqs:
            self.rows[new.request_id] = [len(new.prompt_token_ids), new.num_computed_tokens]
            if new.sampling_params.pooling is not None:
                self.pooling.add(new.request_id)
        cached = so.cached_reqs
        for rid, resumed, computed in zip(
            cached.request_ids, cached.resumed_from_preemption, cached.num_computed_tokens,
            strict=True,
        ):  # fmt: skip
            if resumed:
                self.rows[rid][1] = computed
        req_ids, tokens, pooled = [], [], {}
        for rid, n in so.num_scheduled_tokens.items():
            row = self.rows[rid]
            row[1] += n
            assert row[1] <= row[0], f"{rid}: computes a token it does not know"
            if row[1] == row[0] and rid in self.pooling:  # pools, samples nothing
                pooled[rid] = [float(row[0]), float(sum(map(ord, rid)))]
            elif row[1] == row[0]:
                req_ids.append(rid)
                tokens.append(token_at(rid, row[0]))
                row[0] += 1
        return ModelOutput(req_ids=req_ids, sampled_token_ids=tokens, pooled=pooled)


def make_requests(seed: int, count: int, pool_every: int = 0) -> list[Request]:
    """``pool_every``: every that many requests is an embedding request (prefill only)."""
    rng = random.Random(seed)
    return [
        Request(
            f"r{i}",
            [10 + (j * 7 + i) % 50 for j in range(rng.randint(1, 30))],
            embedding_params(None)
            if pool_every and i % pool_every == 1
            else SamplingParams(max_tokens=rng.randint(1, 25), temperature=0.0),
            frozenset({EOS}),
            64,
        )
        for i in range(count)
    ]


def scheduler(num_blocks: int, budget: int, max_seqs: int) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, True)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, kv, 64)


def drive(
    sched: Scheduler, requests: list[Request], async_steps: bool, abort_seed: int | None = None
) -> dict[str, list[float]]:
    """Run ``requests`` to the end; the embedding requests' vectors."""
    for r in requests:
        sched.add_request(r)
    worker = FakeWorker()
    rng = random.Random(abort_seed)
    in_flight: SchedulerOutput | None = None
    pending = None
    outputs: list[EngineCoreOutput] = []
    for _ in range(5000):
        if not sched.has_unfinished_requests() and in_flight is None:
            break
        if abort_seed is not None and sched.requests and rng.random() < 0.05:
            sched.abort_requests([rng.choice(sorted(sched.requests))])
        so = sched.schedule()
        if async_steps:
            sched.advance(so)
            out = worker.execute(so)  # runs "while" the previous step is reconciled
            if in_flight is not None:
                assert pending is not None
                outputs += sched.update(in_flight, pending, advanced=True)
            in_flight, pending = so, out
        else:
            outputs += sched.update(so, worker.execute(so))
        sched.kv.check_invariants(idle=False)
    assert in_flight is None or not sched.has_unfinished_requests()
    assert not sched.has_unfinished_requests(), "did not finish"
    sched.schedule()  # the last finished ids go out
    sched.kv.check_invariants(idle=True)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    return {o.request_id: o.pooled for o in outputs if o.pooled is not None}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("num_blocks", "budget"), [(64, 64), (24, 16), (18, 8)])
def test_async_tokens_equal_sync_tokens(seed: int, num_blocks: int, budget: int) -> None:
    sync_reqs, async_reqs = make_requests(seed, 10), make_requests(seed, 10)
    sync = scheduler(num_blocks, budget, 6)
    drive(sync, sync_reqs, False)
    fast = scheduler(num_blocks, budget, 6)
    drive(fast, async_reqs, True)
    for s, a in zip(sync_reqs, async_reqs, strict=True):
        assert a.token_ids == s.token_ids, a.request_id
        assert (a.finish_reason, a.stop_reason) == (s.finish_reason, s.stop_reason)
    if num_blocks == 18:
        assert fast.num_preemptions_total > 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("num_blocks", "budget"), [(64, 64), (18, 8), (14, 6)])
def test_async_embeddings_equal_sync(seed: int, num_blocks: int, budget: int) -> None:
    """Embedding requests among generating ones: a request whose prompt the step in flight
    completes is never scheduled again (the fake worker would compute past its prompt), and
    it finishes with its vector, also when the next step's planning preempted it."""
    sync_reqs, async_reqs = make_requests(seed, 12, 3), make_requests(seed, 12, 3)
    sync = drive(scheduler(num_blocks, budget, 6), sync_reqs, False)
    fast = drive(scheduler(num_blocks, budget, 6), async_reqs, True)
    assert fast == sync and len(sync) == 4
    for s, a in zip(sync_reqs, async_reqs, strict=True):
        assert (a.token_ids, a.finish_reason) == (s.token_ids, s.finish_reason), a.request_id
        if a.sampling_params.pooling is not None:
            assert a.finish_reason == FinishReason.LENGTH and a.num_output_tokens == 0


@pytest.mark.parametrize("seed", range(6))
def test_async_with_aborts_frees_every_block(seed: int) -> None:
    requests = make_requests(seed, 10)
    sched = scheduler(20, 12, 6)
    drive(sched, requests, True, abort_seed=seed)
    for r in requests:
        assert r.is_finished
        expected = [token_at(r.request_id, p) for p in range(r.num_prompt_tokens, r.num_tokens)]
        assert r.output_token_ids == expected
