"""Accumulates one scheduling step's decisions before they become a frozen SchedulerOutput."""

from __future__ import annotations

from tokenwire.runtime.core.request import Request
from tokenwire.runtime.scheduler_output import CachedRequestData, NewRequestData


class StepBuilder:
    """Accumulates one step's decisions; turned into a frozen ``SchedulerOutput``."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.new_reqs: list[NewRequestData] = []
        self.cached = CachedRequestData()
        self.num_scheduled: dict[str, int] = {}
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.preempted: list[Request] = []
        self.spec_tokens: dict[str, list[int]] = {}
        # Image inputs: request_id -> image indices to encode; images read from the cache.
        self.encoder_inputs: dict[str, tuple[int, ...]] = {}
        self.num_encoder_cache_hits = 0

    def schedule(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        self.budget -= num_tokens
        # Tokens before the prompt end are prefill; after it (decode or recompute) decode.
        prefill = max(0, min(num_tokens, request.num_prompt_tokens - request.num_computed_tokens))
        self.num_prefill_tokens += prefill
        self.num_decode_tokens += num_tokens - prefill

    def add_cached(self, request: Request, new_block_ids: list[int], resumed: bool) -> None:
        self.cached.request_ids.append(request.request_id)
        self.cached.resumed_from_preemption.append(resumed)
        self.cached.new_block_ids.append(new_block_ids)
        self.cached.num_computed_tokens.append(request.num_computed_tokens)
