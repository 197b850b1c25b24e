"""The plain records that cross between the front and the engine core.

Only token ids, parameters and statistics cross; text stays in the front. In-process the
records are handed over as objects; between processes ``codec`` encodes them with msgspec.
One ``StepResult`` per engine step carries every request's new tokens, the step's and the
finished requests' statistics, and the state snapshot the gauges read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenwire.runtime.core.kv_events import KVEventBatch
from tokenwire.runtime.engine.protocol import EngineInfo, EngineStatsSnapshot, IdleReport
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.runtime.multimodal import ImageInput
from tokenwire.runtime.outputs import EngineCoreOutput
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import RequestStats, StepStats


# ---------------------------------------------------------------------------- front -> core
@dataclass(frozen=True, slots=True)
class ChildRequest:
    """One choice of a request, as the engine core schedules it (``n == 1``)."""

    request_id: str
    params: SamplingParams
    hold_as: str | None = None


@dataclass(frozen=True, slots=True)
class AddRequest:
    """A request's choices, added together: all of them or, on a fault, none."""

    request_id: str
    prompt_token_ids: list[int]
    children: list[ChildRequest]
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    # --data-parallel-size: the core to run on (the vLLM worker protocol's field); None: the
    # front's balancer chooses.
    data_parallel_rank: int | None = None
    # A vision-language model: the prompt's images, placeholders already expanded.
    images: tuple[ImageInput, ...] = ()


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: list[str]  # engine-side (child) ids


@dataclass(frozen=True, slots=True)
class ReleaseHolder:
    holder_id: str


@dataclass(frozen=True, slots=True)
class CheckIdle:
    """Answered with an ``IdleReport`` once every earlier input has been applied."""

    call_id: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class AddLoRA:
    """Check and register a LoRA adapter; answered with a ``LoRAReply``."""

    call_id: int
    name: str
    path: str


@dataclass(frozen=True, slots=True)
class RemoveLoRA:
    """Unregister a LoRA adapter (its running requests finish first); a ``LoRAReply``."""

    call_id: int
    name: str


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Forget every cached block; answered with a ``ResetReply`` (refused while in use)."""

    call_id: int


CoreInput = (
    AddRequest
    | AbortRequests
    | ReleaseHolder
    | CheckIdle
    | Shutdown
    | AddLoRA
    | RemoveLoRA
    | ResetPrefixCache
)


# ---------------------------------------------------------------------------- core -> front
@dataclass(frozen=True, slots=True)
class RequestFault:
    """Adding a request failed inside the core (an engine fault, never a bad parameter)."""

    request_id: str
    message: str


@dataclass(frozen=True, slots=True)
class StepResult:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    steps: list[StepStats] = field(default_factory=list)
    finished: list[RequestStats] = field(default_factory=list)
    evicted_holders: list[str] = field(default_factory=list)
    faults: list[RequestFault] = field(default_factory=list)
    snapshot: EngineStatsSnapshot | None = None
    # The KV-cache events of this step (None when there are none or they are off).
    kv_events: KVEventBatch | None = None


@dataclass(frozen=True, slots=True)
class CoreStarted:
    info: EngineInfo


@dataclass(frozen=True, slots=True)
class IdleReply:
    call_id: int
    report: IdleReport


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """The core cannot go on: it failed to start (``startup``) or its loop crashed."""

    message: str
    startup: bool = False


@dataclass(frozen=True, slots=True)
class LoRAReply:
    """The answer to ``AddLoRA`` / ``RemoveLoRA``: the adapter, or why not (``error`` is
    "invalid", "exists" or "not_found"; ``param`` names the bad field of an invalid one)."""

    call_id: int
    lora: LoRARequest | None = None
    error: str = ""
    param: str = ""
    message: str = ""


@dataclass(frozen=True, slots=True)
class ResetReply:
    call_id: int
    ok: bool


CoreOutput = StepResult | CoreStarted | IdleReply | CoreFailed | LoRAReply | ResetReply
