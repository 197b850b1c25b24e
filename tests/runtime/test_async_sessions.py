"""Async scheduling with Session holds (``hold_as``: a turn's KV stays referenced after it
finishes, so the next turn of the Session gets a prefix hit on it): multi-turn Sessions next
to plain requests give the same greedy and seeded tokens as synchronous scheduling, the steps
overlap, later turns hit the held KV, and once every Session is closed (its holder released)
every KV block is free; also when holders are evicted under memory pressure, and when a turn
is aborted while a step is in flight."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from step_overlap import overlapped, steps_of

from tokenwire.runtime.engine.core import EngineCore
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder

# Engine runs over several turns: in make test, not in make test-fast.
pytestmark = pytest.mark.slow

# Two Sessions' user turns (token ids) and the sampling of each Session.
TURNS: dict[str, list[list[int]]] = {
    "s1": [list(range(20, 45)), [50, 51, 52], [60, 61, 62, 63, 64]],
    "s2": [[5, 6, 7, 8, 9, 10, 11], list(range(100, 118)), [7, 8]],
}
SESSION_PARAMS: dict[str, SamplingParams] = {
    "s1": SamplingParams(temperature=0.0, max_tokens=9),
    "s2": SamplingParams(temperature=0.9, top_k=40, seed=11, max_tokens=12),
}
FREE = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
Transcript = dict[str, list[list[int]]]
Run = tuple[Transcript, int, int]  # the tokens, blocks held before closing, preemptions


def drain(engine: EngineCore, tokens: dict[str, list[int]], abort: str | None = None) -> int:
    """Step until nothing is unfinished; ``abort``: that request is aborted at the 3rd step.
    Returns how many requests had a prefix hit."""
    steps = 0
    hits: set[str] = set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.num_cached_tokens > 0:
                hits.add(output.request_id)
        steps += 1
        if steps == 3 and abort is not None:
            engine.abort_requests([abort])
    return len(hits)


def converse(model: Path, async_scheduling: bool, abort: str | None, **kw: Any) -> Run:
    """Every turn of both Sessions (each turn's prompt: the conversation so far plus the new
    user tokens), each round next to a plain request; then the Sessions close."""
    llm = LLM(
        str(model), device="cpu", observer=StepRecorder(), async_scheduling=async_scheduling, **kw
    )
    engine = llm.engine
    history: dict[str, list[int]] = {sid: [] for sid in TURNS}
    transcript: Transcript = {sid: [] for sid in TURNS}
    hits = 0
    for turn in range(3):
        tokens: dict[str, list[int]] = {}
        for sid, turns in TURNS.items():
            history[sid] += turns[turn]
            rid = f"{sid}/{turn}"
            engine.add_request(rid, list(history[sid]), SESSION_PARAMS[sid], hold_as=sid)
        engine.add_request(f"free/{turn}", [300 + turn, 301, 302, 303], FREE)
        hits += drain(engine, tokens, abort=None if turn != 1 else abort)
        for sid in TURNS:
            out = tokens.get(f"{sid}/{turn}", [])
            transcript[sid].append(out)
            history[sid] += out
        transcript.setdefault("free", []).append(tokens[f"free/{turn}"])
    assert hits > 0  # later turns reused held KV
    assert overlapped(steps_of(llm).steps) == async_scheduling
    kv = engine.kv_cache_manager
    held = kv.num_held_blocks
    for sid in TURNS:  # the Sessions close
        engine.release_holder(sid)
    assert not engine.has_unfinished_requests()
    kv.check_invariants(idle=True)
    assert kv.num_free_blocks == kv.num_blocks
    return transcript, held, engine.scheduler.num_preemptions_total


CASES: dict[str, dict[str, Any]] = {
    "roomy": {},
    # 20 usable 4-token blocks: held tables are evicted and turns are preempted.
    "cramped": {"block_size": 4, "num_gpu_blocks_override": 21, "max_model_len": 80},
    "chunked": {"max_num_batched_tokens": 8},
}


@pytest.mark.parametrize("case", list(CASES))
def test_sessions_async_equal_sync(tiny_model_factory: Callable[..., Path], case: str) -> None:
    model = tiny_model_factory("llama")
    sync, sync_held, sync_preempted = converse(model, False, None, **CASES[case])
    fast, held, preempted = converse(model, True, None, **CASES[case])
    assert fast == sync
    assert all(len(out) > 0 for turns in fast.values() for out in turns)
    if case == "cramped":  # the held tables did not fit: evicted
        assert preempted > 0 and sync_preempted > 0
    else:  # the last turns' tables, held until the Sessions closed
        assert held > 0 and sync_held > 0


def test_session_turn_aborted_mid_run(tiny_model_factory: Callable[..., Path]) -> None:
    """A Session turn aborted while a step is in flight keeps its held table consistent: the
    other turns are unchanged, and every block is free once the Sessions close."""
    model = tiny_model_factory("llama")
    sync, _, _ = converse(model, False, "s1/1")
    fast, _, _ = converse(model, True, "s1/1")
    assert fast["s2"] == sync["s2"] and fast["free"] == sync["free"]
    assert fast["s1"][0] == sync["s1"][0]
