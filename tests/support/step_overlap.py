"""Async scheduling checks on a recorded run: whether steps overlapped (a step planned before
the one ahead of it was reconciled), and the engine's step recorder."""

from __future__ import annotations

import itertools

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.stats import StepRecorder, StepStats


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
