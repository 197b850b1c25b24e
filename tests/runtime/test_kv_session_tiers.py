"""Sessions on the KV tiers (docs/kv-tiers.md): under device pressure an idle Session's held
table moves down to the host tier instead of being dropped (no ``CONTEXT_EVICTED``), and its
next turn loads it back and prefills only the new tokens. Real engine: a device cache that
holds about two Sessions' transcripts, eight live Sessions, a larger host tier; greedy tokens
equal a run with a device cache big enough for everything; synchronous and async scheduling;
once the Sessions close the engine is idle and no block is held on the device or the host."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tokenwire.runtime.core.kv_connector import OffloadingConnector
from tokenwire.runtime.engine.core import EngineCore
from tokenwire.runtime.engine.core_loop import idle_report
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # an engine over many turns: in make test

BLOCK = 4
NUM_SESSIONS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# 24 usable blocks of 4 tokens (96 tokens): the last transcripts are 44 tokens (11 blocks).
SMALL: dict[str, Any] = {"block_size": BLOCK, "num_gpu_blocks_override": 25, "max_model_len": 96}
BIG: dict[str, Any] = {"block_size": BLOCK, "num_gpu_blocks_override": 400, "max_model_len": 96}


def user_turn(sid: int, turn: int) -> list[int]:
    """Session ``sid``'s user tokens at ``turn``: 20 tokens first, then 6 per turn."""
    n = 20 if turn == 0 else 6
    return [(sid * 37 + turn * 11 + i * 7) % 450 + 3 for i in range(n)]


def run(engine: EngineCore, request_id: str, prompt: list[int], sid: str) -> tuple[list[int], int]:
    """One Session turn alone in the engine: its tokens and cached prompt tokens."""
    engine.add_request(request_id, prompt, GREEDY, hold_as=sid)
    tokens: list[int] = []
    cached = -1
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.extend(output.new_token_ids)
            if output.request_id == request_id and output.num_cached_tokens >= 0:
                cached = max(cached, output.num_cached_tokens)
    return tokens, cached


def converse(model: Path, async_scheduling: bool, **kw: Any) -> tuple[list[list[int]], LLM]:
    """Three turns of every Session, round-robin (each turn's prompt: the transcript so far
    plus the new user tokens); asserts every later turn hit its transcript; then they close."""
    llm = LLM(str(model), device="cpu", async_scheduling=async_scheduling, **kw)
    engine = llm.engine
    history: dict[int, list[int]] = {s: [] for s in range(NUM_SESSIONS)}
    outputs: list[list[int]] = []
    evicted: list[str] = []
    for turn in range(3):
        for s in range(NUM_SESSIONS):
            transcript = len(history[s])  # what the Session held: its KV came from a tier
            history[s] += user_turn(s, turn)
            tokens, cached = run(engine, f"s{s}/{turn}", list(history[s]), f"s{s}")
            if turn > 0:  # all of it but the partial last block: only new tokens computed
                assert cached >= transcript - BLOCK, (s, turn, cached, transcript)
            history[s] += tokens
            outputs.append(tokens)
            evicted += engine.pop_evicted_holders()
    assert evicted == []  # every Session moved down a tier: no CONTEXT_EVICTED
    for s in range(NUM_SESSIONS):
        engine.release_holder(f"s{s}")
    assert not engine.has_unfinished_requests()
    kv = engine.kv_cache_manager
    kv.check_invariants(idle=True)
    assert kv.num_free_blocks == kv.num_blocks
    connector = engine.scheduler.connector
    if connector is not None:
        assert isinstance(connector, OffloadingConnector)
        connector.check_invariants(idle=True)  # no host slot pinned, no load, no copy queued
        assert connector.tier.num_pinned == 0
    assert idle_report(engine).all_free  # what a server's idle check reads
    return outputs, llm


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_sessions_move_down_to_the_host_tier(
    tiny_model_factory: Callable[..., Path], async_scheduling: bool
) -> None:
    model = tiny_model_factory("llama")
    want, _ = converse_big(model)
    got, llm = converse(model, async_scheduling, kv_offloading_size=0.01, **SMALL)
    assert got == want
    connector = llm.engine.scheduler.connector
    assert isinstance(connector, OffloadingConnector)
    stats = connector.stats()
    assert stats.blocks_saved > 0 and stats.blocks_loaded > 0


def converse_big(model: Path) -> tuple[list[list[int]], LLM]:
    """The reference: a device cache that never evicts a Session."""
    llm = LLM(str(model), device="cpu", **BIG)
    engine = llm.engine
    history: dict[int, list[int]] = {s: [] for s in range(NUM_SESSIONS)}
    outputs: list[list[int]] = []
    for turn in range(3):
        for s in range(NUM_SESSIONS):
            history[s] += user_turn(s, turn)
            tokens, _ = run(engine, f"s{s}/{turn}", list(history[s]), f"s{s}")
            history[s] += tokens
            outputs.append(tokens)
    for s in range(NUM_SESSIONS):
        engine.release_holder(f"s{s}")
    return outputs, llm


def test_without_a_tier_sessions_are_evicted(tiny_model_factory: Callable[..., Path]) -> None:
    """The same traffic without a host tier: held tables are dropped and reported."""
    model = tiny_model_factory("llama")
    llm = LLM(str(model), device="cpu", **SMALL)
    engine = llm.engine
    evicted: list[str] = []
    for s in range(NUM_SESSIONS):
        run(engine, f"s{s}/0", user_turn(s, 0), f"s{s}")
        evicted += engine.pop_evicted_holders()
    assert evicted
    for s in range(NUM_SESSIONS):
        engine.release_holder(f"s{s}")
    engine.kv_cache_manager.check_invariants(idle=True)


def test_a_full_host_tier_evicts_sessions(tiny_model_factory: Callable[..., Path]) -> None:
    """A host tier that holds about one Session's table: the Sessions that do not fit next to
    the pinned ones are evicted (reported), the others move down; every turn still equals the
    big-cache run, and closing every Session leaves both tiers idle."""
    model = tiny_model_factory("llama")
    want, _ = converse_big(model)
    probe = LLM(str(model), device="cpu", kv_offloading_size=0.01, **SMALL)
    connector = probe.engine.scheduler.connector
    assert isinstance(connector, OffloadingConnector)
    gib = 12 * connector.block_bytes / 2**30  # 12 host blocks
    llm = LLM(str(model), device="cpu", kv_offloading_size=gib, **SMALL)
    engine = llm.engine
    history: dict[int, list[int]] = {s: [] for s in range(NUM_SESSIONS)}
    got: list[list[int]] = []
    evicted: list[str] = []
    tier = engine.scheduler.connector
    assert isinstance(tier, OffloadingConnector) and tier.tier.num_slots == 12
    # Sessions pin at most session_cache_fraction (0.5) of the tier: 6 host slots.
    assert tier.sessions.max_host_slots == 6
    most_pinned = 0
    for turn in range(3):
        for s in range(NUM_SESSIONS):
            history[s] += user_turn(s, turn)
            tokens, _ = run(engine, f"s{s}/{turn}", list(history[s]), f"s{s}")
            history[s] += tokens
            got.append(tokens)
            evicted += engine.pop_evicted_holders()
            report = idle_report(engine)  # a Session that moved down holds its host slots
            assert report.num_tier_held_blocks == tier.stats().session_blocks <= 6
            assert report.invariant_error is None
            most_pinned = max(most_pinned, report.num_tier_held_blocks)
    assert got == want
    assert evicted  # the tier was full
    assert most_pinned > 0
    for s in range(NUM_SESSIONS):
        engine.release_holder(f"s{s}")
    engine.kv_cache_manager.check_invariants(idle=True)
    tier.check_invariants(idle=True)
    assert idle_report(engine).all_free


def test_sessions_that_do_not_fit_the_host_tier_move_to_the_disk(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """The 12-block host tier of the test above, with a disk tier under it: the Sessions that
    do not fit in host memory move to the disk instead of being evicted; every later turn
    still hits its transcript, tokens equal the big-cache run, and both tiers end idle."""
    model = tiny_model_factory("llama")
    want, _ = converse_big(model)
    probe = LLM(str(model), device="cpu", kv_offloading_size=0.01, **SMALL)
    connector = probe.engine.scheduler.connector
    assert isinstance(connector, OffloadingConnector)
    gib = 12 * connector.block_bytes / 2**30  # 12 host blocks
    disk = {"kv_offloading_disk_path": str(tmp_path), "kv_offloading_disk_size": 1 / 1024}
    got, llm = converse(model, False, kv_offloading_size=gib, **disk, **SMALL)
    assert got == want
    tiers = llm.engine.scheduler.connector
    assert isinstance(tiers, OffloadingConnector) and tiers.disk is not None
    stats = tiers.stats()
    assert stats.disk_blocks_saved > 0 and stats.disk_blocks_loaded > 0
    assert stats.disk_load_failures == 0
