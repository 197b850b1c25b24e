"""Records between the engine core and its worker processes, and among the workers.

The core sends each step's ``SchedulerOutput`` to rank 0, which broadcasts the same bytes to
every rank over the group's gloo channel (so ranks on other nodes need no socket to the
core); rank 0 returns the ``ModelOutput``. Everything is msgspec-encoded, never pickled.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenwire.runtime.ipc.codec import TaggedCodec
from tokenwire.runtime.model_facts import ModelFacts
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.scheduler_output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class Step:
    scheduler_output: SchedulerOutput


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Rank 0 keeps an idle group's collectives from timing out (and notices a dead peer)."""


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class WorkerReady:
    facts: ModelFacts


@dataclass(frozen=True, slots=True)
class StepDone:
    model_output: ModelOutput


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    rank: int
    message: str
    startup: bool = False


class ExecutorCodec(TaggedCodec):
    def __init__(self) -> None:
        super().__init__((Step, Heartbeat, Stop, WorkerReady, StepDone, WorkerFailed))
