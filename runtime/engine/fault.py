"""Test-only fault injection into the engine core: ``TOKENWIRE_TEST_FAULT="step:N"`` makes the
N-th ``execute_model`` call of the core (1-based, warm-up steps included) raise
``InjectedFault`` before the executor runs; ``"slow:MS"`` makes every ``execute_model`` call
take MS milliseconds longer (a tiny model stepping like a big one on a loaded box: the fleet
tests use it to drive a gateway's liveness checks); ``"step:N,slow:MS"`` does both (the fault
tests use it so that every call they start is admitted before the N-th step, however loaded
the box).

Read once when the ``EngineCore`` is built (in the core's own process under ``serve``, which
inherits the server's environment). Unset or empty: no hook at all. What follows a fault is
the engine's ordinary failure path (see tests/e2e/test_faults.py): the core loop ends, the front
declares the engine dead, in-flight requests end UNAVAILABLE / ENGINE_DEAD and the server
drains and exits 1. Never set it in production.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

FAULT_ENV = "TOKENWIRE_TEST_FAULT"


class InjectedFault(RuntimeError):
    """The fault ``TOKENWIRE_TEST_FAULT`` asked for."""


@dataclass(frozen=True)
class FaultPlan:
    """Raise at the ``step``-th ``execute_model`` call (1-based; 0: never), or delay every call
    by ``slow_ms``."""

    step: int
    slow_ms: int = 0

    def __post_init__(self) -> None:
        if self.step < 0 or (self.step == 0 and self.slow_ms <= 0):
            raise ValueError(f"{FAULT_ENV}: step must be >= 1, got {self.step}")
        if self.slow_ms < 0:
            raise ValueError(f"{FAULT_ENV}: slow must be >= 0 ms, got {self.slow_ms}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultPlan | None:
        """The plan in ``environ`` (default ``os.environ``); None when unset or empty."""
        raw = (os.environ if environ is None else environ).get(FAULT_ENV, "").strip()
        if not raw:
            return None
        parts: dict[str, int] = {}
        for item in raw.split(","):
            kind, _, value = item.strip().partition(":")
            valid = value.strip().isdigit() and int(value) >= 1
            if kind not in ("step", "slow") or kind in parts or not valid:
                raise ValueError(
                    f'{FAULT_ENV}={raw!r}: expected "step:N", "slow:MS" or "step:N,slow:MS" '
                    "with N >= 1"
                )
            parts[kind] = int(value)
        return cls(parts.get("step", 0), slow_ms=parts.get("slow", 0))


class StepFault:
    """Counts ``execute_model`` calls and raises at the planned one (once)."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self.calls = 0

    def before_execute(self) -> None:
        self.calls += 1
        if self.plan.slow_ms:
            time.sleep(self.plan.slow_ms / 1000)
        if self.calls == self.plan.step:
            raise InjectedFault(f"{FAULT_ENV}: injected fault at execute_model call {self.calls}")


def step_fault_from_env(environ: Mapping[str, str] | None = None) -> StepFault | None:
    """The hook ``EngineCore`` installs, or None (the normal case)."""
    plan = FaultPlan.from_env(environ)
    return None if plan is None else StepFault(plan)
