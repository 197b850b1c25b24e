"""The KV tiers with a draft model (``draft_model`` speculation, docs/kv-tiers.md): a prefix
evicted from a small device cache and brought back from the host tier (or the disk tier under
it), synchronous and ``--async-scheduling``, gives the same greedy tokens and the same drafts
and accepted drafts per request as a run whose device cache never evicted.

The tiers move the target's KV only. The draft's KV in a block a tier brings back is stale
(whatever the device block held before), and it is never read: a new request's draft catches
up from position 0 (``worker/spec/draft_model.py``). The tests make that stale KV loud: the
whole draft cache is overwritten with large random values before the prefix comes back, and
the target is its own draft, so a single stale read would show as a rejected draft."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checks import assert_llm_idle
from test_kv_offload import A, B, C, connector_hashes

from tokenwire.runtime.core.kv_connector import OffloadingConnector
from tokenwire.runtime.executor.uniproc import UniprocExecutor
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.outputs import RequestOutput
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import RequestStats, StepRecorder
from tokenwire.runtime.worker.model_runner import ModelRunner

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
HOST_BLOCKS = 2  # with a disk tier: most of A's blocks go on to the disk


@pytest.fixture(scope="module")
def target(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture
def llms() -> Iterator[list[LLM]]:
    made: list[LLM] = []
    yield made
    for llm in made:
        llm.shutdown()


def make_llm(target: Path, draft: Path, blocks: int, llms: list[LLM], **kw: Any) -> LLM:
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(
        str(target),
        device="cpu",
        max_model_len=64,
        block_size=4,
        num_gpu_blocks_override=blocks,
        speculative_config=spec,
        observer=StepRecorder(),
        **kw,
    )
    llms.append(llm)
    return llm


def noisy_copy(target: Path, out: Path, scale: float) -> Path:
    """``target`` with noise added to every weight (``scale`` of its std, seeded): a draft
    that agrees with the target often but not always."""
    from safetensors.torch import load_file, save_file

    out.mkdir(exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    for f in target.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    for f in target.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if t.is_floating_point() and t.numel() > 1:
                noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
                tensors[name] = t + (noise * scale * t.float().std()).to(t.dtype)
        save_file(tensors, out / f.name, metadata={"format": "pt"})
    return out


def poison_draft_cache(llm: LLM) -> None:
    """Every block's draft KV becomes large random values (the engine is idle: no request
    holds a block, so only cached prefix blocks' stale draft slots are hit)."""
    assert_llm_idle(llm)
    executor = llm.engine.executor
    assert isinstance(executor, UniprocExecutor)
    runner = executor.worker.runner
    assert isinstance(runner, ModelRunner) and runner.drafter is not None
    drafter = runner.drafter
    gen = torch.Generator().manual_seed(0)
    for layer in drafter.kv_cache.layers:
        for cache in (layer.k_cache, layer.v_cache):
            cache.copy_(torch.randn(cache.shape, generator=gen, dtype=cache.dtype) * 50)


def run_a_b_c_a(llm: LLM) -> tuple[list[RequestOutput], list[RequestStats]]:
    """A, B and C (A's blocks leave the device), then A again after the draft cache is
    poisoned; each output and its request's figures (drafts, accepted, tier loads)."""
    return run_rest(llm, [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in (A, B, C)])


def run_rest(llm: LLM, outs: list[RequestOutput]) -> tuple[list[RequestOutput], list[RequestStats]]:
    """``run_a_b_c_a`` after its first three requests ran."""
    poison_draft_cache(llm)
    outs = [*outs, llm.generate([A], PARAMS, use_tqdm=False)[0]]
    recorder = llm.engine.observer
    assert isinstance(recorder, StepRecorder)
    return outs, list(recorder.requests)


def assert_same_speculation(
    got: tuple[list[RequestOutput], list[RequestStats]],
    want: tuple[list[RequestOutput], list[RequestStats]],
) -> None:
    assert [o.outputs[0].token_ids for o in got[0]] == [o.outputs[0].token_ids for o in want[0]]
    drafts = [(r.num_draft_tokens, r.num_accepted_tokens) for r in got[1]]
    assert drafts == [(r.num_draft_tokens, r.num_accepted_tokens) for r in want[1]]
    assert all(d > 0 for d, _ in drafts)


def connector_of(llm: LLM) -> OffloadingConnector:
    connector = llm.engine.scheduler.connector
    assert isinstance(connector, OffloadingConnector)
    return connector


def assert_a_came_back(llm: LLM, outs: list[RequestOutput], stats: list[RequestStats]) -> None:
    assert outs[3].num_cached_tokens == 28  # every full block before the last token
    assert stats[3].num_tier_loaded_tokens == 28  # all of them from a tier, none from the device
    assert all(r.num_tier_loaded_tokens == 0 for r in stats[:3])


def assert_tiers_idle(llm: LLM) -> None:
    assert_llm_idle(llm)
    connector_of(llm).check_invariants(idle=True)  # every tier: nothing pinned or in flight


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("draft_kind", ["self", "other"])
def test_host_tier_with_a_draft_matches_a_run_that_never_evicted(
    target: Path,
    tmp_path: Path,
    llms: list[LLM],
    async_scheduling: bool,
    draft_kind: str,
) -> None:
    """``self``: the target drafts for itself (every draft accepted unless the draft reads
    stale KV); ``other``: the target with 3 % noise on its weights (about 2 drafts in 5
    accepted: the counts per request must match)."""
    draft = target
    if draft_kind == "other":
        draft = noisy_copy(target, tmp_path / "noisy", 0.03)
    kw = {"async_scheduling": async_scheduling}
    want = run_a_b_c_a(make_llm(target, draft, 64, llms, **kw))  # never evicts
    llm = make_llm(target, draft, 17, llms, kv_offloading_size=0.01, **kw)
    got = run_a_b_c_a(llm)
    assert_a_came_back(llm, *got)
    stats = connector_of(llm).stats()
    assert stats.blocks_loaded == 7 and stats.bytes_loaded == 7 * llm.engine.facts.kv_block_bytes
    assert_same_speculation(got, want)
    if draft_kind == "self":
        assert all(r.num_accepted_tokens == r.num_draft_tokens for r in got[1])
    else:
        assert all(0 < r.num_accepted_tokens < r.num_draft_tokens for r in got[1])
    assert_tiers_idle(llm)
    assert_llm_idle(llms[0])


def test_disk_tier_with_a_draft_matches_a_run_that_never_evicted(
    target: Path, tmp_path: Path, llms: list[LLM]
) -> None:
    want = run_a_b_c_a(make_llm(target, target, 64, llms))
    block_bytes = make_llm(target, target, 17, llms, kv_offloading_size=0.01).engine.facts
    host_gib = HOST_BLOCKS * block_bytes.kv_block_bytes / (1 << 30)
    llm = make_llm(
        target, target, 17, llms, kv_offloading_size=host_gib,
        kv_offloading_disk_path=str(tmp_path), kv_offloading_disk_size=1 / 1024,
    )  # fmt: skip
    outs = [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in (A, B, C)]
    connector = connector_of(llm)
    assert connector.disk is not None
    assert sum(h in connector.disk.index for h in connector_hashes(llm, A)) >= 5
    got = run_rest(llm, outs)
    assert_a_came_back(llm, *got)
    stats = connector.stats()
    assert stats.capacity_blocks == HOST_BLOCKS
    assert stats.disk_blocks_loaded >= 5 and stats.disk_load_failures == 0
    assert_same_speculation(got, want)
    assert all(r.num_accepted_tokens == r.num_draft_tokens for r in got[1])
    assert_tiers_idle(llm)


@pytest.mark.slow
def test_tp2_host_tier_with_a_draft_matches_a_run_that_never_evicted(
    target: Path, llms: list[LLM]
) -> None:
    """TP=2 (gloo, real worker processes): each rank moves its shard of the target's KV; the
    draft (sharded like the target) catches up on every rank. The draft's stale KV here is
    what B and C left in the reused blocks (the ranks' caches cannot be poisoned from here)."""

    def run(llm: LLM) -> tuple[list[RequestOutput], list[RequestStats]]:
        outs = [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in (A, B, C, A)]
        recorder = llm.engine.observer
        assert isinstance(recorder, StepRecorder)
        return outs, list(recorder.requests)

    want = run(make_llm(target, target, 64, llms, tensor_parallel_size=2))
    llm = make_llm(target, target, 17, llms, tensor_parallel_size=2, kv_offloading_size=0.01)
    got = run(llm)
    assert_a_came_back(llm, *got)
    assert connector_of(llm).stats().blocks_loaded == 7
    assert_same_speculation(got, want)
    assert all(r.num_accepted_tokens == r.num_draft_tokens for r in got[1])
    assert_tiers_idle(llm)
