"""Plain records the engine reports to its observer (telemetry turns them into spans/metrics).

Durations are seconds (``time.perf_counter``); ``*_time`` instants are ``time.monotonic``;
``started_at_ns`` is wall-clock (``time.time_ns``) so spans can be placed on a timeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from tokenwire.runtime.outputs import FinishReason

StepPhase = Literal["prefill", "decode", "mixed"]


@dataclass(frozen=True, slots=True)
class StepStats:
    step_id: int
    phase: StepPhase
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preemptions: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    # request_id -> tokens computed for it in this step, and whether they were prompt tokens.
    scheduled: dict[str, int]
    prefill_req_ids: frozenset[str]
    schedule_time: float
    prepare_time: float
    forward_time: float
    sample_time: float
    update_time: float
    started_at_ns: int
    duration: float
    num_waiting: int = 0  # requests left in the waiting queue after scheduling
    # Tensor parallelism: rank 0's time in all-reduce / all-gather (within forward/sample).
    collective_time: float = 0.0
    # Speculative decoding: drafts verified and accepted this step; accepted_per_pos[j] counts
    # requests whose (j+1)-th draft was accepted, drafted_per_pos[j] those that had one.
    num_drafts: int = 0  # requests that had drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_pos: tuple[int, ...] = ()
    accepted_per_pos: tuple[int, ...] = ()
    dp_rank: int = 0  # --data-parallel-size: the engine core that ran the step
    # Image inputs: images encoded (distinct content hashes), images read from the
    # encoder-output cache instead, and the encoder's seconds (within prepare_time).
    num_images_encoded: int = 0
    num_encoder_cache_hits: int = 0
    encoder_time: float = 0.0

    @property
    def overhead_time(self) -> float:
        """Engine bookkeeping: schedule + input preparation + update (no forward, no sample)."""
        return self.schedule_time + self.prepare_time + self.update_time


@dataclass(frozen=True, slots=True)
class RequestStats:
    request_id: str
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    finish_reason: FinishReason
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for it
    num_accepted_tokens: int = 0  # and accepted
    dp_rank: int = 0  # --data-parallel-size: the engine core that served it
    # KV tiers: prompt tokens whose KV came back from the host/disk tiers, and how long the
    # loads took (seconds from scheduling to acknowledgement, summed).
    num_tier_loaded_tokens: int = 0
    tier_load_time: float = 0.0


class EngineObserver(Protocol):
    """Receives engine events on the engine thread; must be cheap and never raise."""

    def on_step(self, stats: StepStats) -> None: ...

    def on_request_finished(self, stats: RequestStats) -> None: ...


class StepRecorder:
    """An observer that keeps every step and finished-request record in arrival order: the one
    recorder benchmarks and tests read (appends only, so the engine thread never blocks)."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self.requests: list[RequestStats] = []

    def on_step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def on_request_finished(self, stats: RequestStats) -> None:
        self.requests.append(stats)

    @property
    def finished(self) -> dict[str, RequestStats]:
        """Finished requests by request id (the last record wins if an id was reused)."""
        return {r.request_id: r for r in list(self.requests)}

    def steps_of(self, request_id: str) -> list[StepStats]:
        return [s for s in list(self.steps) if request_id in s.scheduled]

    @property
    def drafted(self) -> int:
        """Speculative tokens verified over all steps."""
        return sum(s.num_draft_tokens for s in list(self.steps))

    @property
    def accepted(self) -> int:
        return sum(s.num_accepted_tokens for s in list(self.steps))


@dataclass(frozen=True, slots=True)
class KVOffloadStats:
    """The host KV tier (``--kv-offloading-size``): its size in blocks and monotonic counters
    of what moved (docs/kv-tiers.md). All zero when the tier is off."""

    capacity_blocks: int = 0
    used_blocks: int = 0
    blocks_saved: int = 0  # device blocks copied to the host tier at eviction
    blocks_loaded: int = 0  # host-tier hits copied back to the device
    bytes_saved: int = 0
    bytes_loaded: int = 0
    loads_in_flight: int = 0
    load_time: float = 0.0  # seconds from scheduling a load to its acknowledgement, summed
    session_blocks: int = 0  # host blocks pinned by idle Sessions that moved down a tier
    # The disk tier under it (``--kv-offloading-disk-path``); all zero when it is off.
    disk_capacity_blocks: int = 0
    disk_used_blocks: int = 0
    disk_blocks_saved: int = 0  # host-tier evictions (or device blocks) written to disk
    disk_blocks_loaded: int = 0  # disk hits copied to the device (also in blocks_loaded)
    disk_bytes_saved: int = 0
    disk_bytes_loaded: int = 0
    disk_load_failures: int = 0  # records that failed their checks at load: ignored, a miss
