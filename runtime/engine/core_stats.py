"""The engine core's observer records: a step's ``StepStats`` (from its scheduler output, its
model output, the KV cache's occupancy and the step's timings) and a finished request's
``RequestStats``. Plain functions over plain inputs; ``EngineCore`` hands them to its
``EngineObserver``.
"""

from __future__ import annotations

import time

from tokenwire.runtime.core.kv_cache_manager import KVCacheManager
from tokenwire.runtime.core.request import Request
from tokenwire.runtime.core.spec.accept import spec_step_stats
from tokenwire.runtime.model_output import ModelOutput
from tokenwire.runtime.scheduler_output import SchedulerOutput
from tokenwire.runtime.stats import RequestStats, StepPhase, StepStats


def step_stats(
    so: SchedulerOutput,
    mo: ModelOutput,
    kv: KVCacheManager,
    num_waiting: int,
    dp_rank: int,
    schedule: float,
    update: float,
    started_ns: int,
    duration: float,
) -> StepStats:
    """One step's record: ``schedule`` / ``update``: the scheduler's seconds either side of
    the model; ``started_ns``: wall clock at the step's start; ``duration``: its seconds."""
    phase: StepPhase
    if so.num_prefill_tokens and so.num_decode_tokens:
        phase = "mixed"
    else:
        phase = "prefill" if so.num_prefill_tokens else "decode"
    prefill_ids = frozenset(rid for rid, n in so.num_scheduled_tokens.items() if n > 1)
    return StepStats(
        step_id=so.step_id,
        phase=phase,
        num_seqs=len(so.num_scheduled_tokens),
        num_prefill_tokens=so.num_prefill_tokens,
        num_decode_tokens=so.num_decode_tokens,
        num_preemptions=len(so.preempted_req_ids),
        kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
        kv_blocks_free=kv.num_free_blocks,
        kv_blocks_total=kv.num_blocks,
        scheduled=dict(so.num_scheduled_tokens),
        prefill_req_ids=prefill_ids,
        schedule_time=schedule,
        prepare_time=mo.prepare_time,
        forward_time=mo.forward_time,
        sample_time=mo.sample_time,
        update_time=update,
        started_at_ns=started_ns,
        duration=duration,
        num_waiting=num_waiting,
        collective_time=mo.collective_time,
        dp_rank=dp_rank,
        num_images_encoded=mo.num_images_encoded,
        num_encoder_cache_hits=so.num_encoder_cache_hits,
        encoder_time=mo.encoder_time,
        **spec_step_stats(so.spec_token_ids, mo.extra_token_ids),
    )


def request_stats(request: Request, dp_rank: int, block_size: int) -> RequestStats:
    """A finished request's record (``request.finish_reason`` is set)."""
    assert request.finish_reason is not None
    return RequestStats(
        request_id=request.request_id,
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        finished_time=request.finished_time or time.monotonic(),
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        num_preemptions=request.num_preemptions,
        finish_reason=request.finish_reason,
        num_draft_tokens=request.num_draft_tokens,
        num_accepted_tokens=request.num_accepted_tokens,
        dp_rank=dp_rank,
        num_tier_loaded_tokens=request.tier_loaded_blocks * block_size,
        tier_load_time=request.tier_load_time,
    )
