"""Async scheduling checks on a recorded run: whether steps overlapped (a step planned before
the one ahead of it was reconciled), and the engine's step recorder."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder, StepStats


def run_aborting_b(
    llm: LLM, prompts: Sequence[list[int]], params: SamplingParams, abort_at: int = 5
) -> dict[str, list[int]]:
    """Requests "a", "b", "c" on ``prompts``, stepped by hand; "b" is aborted after
    ``abort_at`` steps and the rest run to the end. Each request's tokens."""
    engine = llm.engine
    for rid, prompt in zip("abc", prompts, strict=False):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in "abc"}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
        steps += 1
        if steps == abort_at:
            engine.abort_requests(["b"])
    return tokens


def steps_of(llm: LLM) -> StepRecorder:
    recorder = llm.engine.observer
    assert isinstance(recorder, StepRecorder)
    return recorder


def overlapped(steps: list[StepStats]) -> bool:
    """Whether some step was planned before the step ahead of it was reconciled."""
    ordered = sorted(steps, key=lambda s: s.step_id)
    return any(
        later.started_at_ns < earlier.started_at_ns + earlier.duration * 1e9
        for earlier, later in itertools.pairwise(ordered)
    )
