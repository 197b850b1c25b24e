"""Scheduler-side state of one engine request (one choice; ``n > 1`` fans out to children).

A ``Request`` is owned by the scheduler thread. Its progress (``num_computed_tokens``, output
tokens, status) advances only in ``Scheduler.update`` (under async scheduling
``num_computed_tokens`` advances when the step is scheduled: ``core.placeholders``); the
block manager keeps the request's block ids and block hashes, keyed by ``request_id``.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from tokenwire.runtime.outputs import FinishReason
from tokenwire.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenwire.runtime.lora.request import LoRARequest
    from tokenwire.runtime.multimodal import ImageInput
    from tokenwire.runtime.structured.request_grammar import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue; its blocks were freed (recompute)
    FINISHED = 3


class Request:
    """One sequence being generated. Token counts are in tokens, times in ``time.monotonic``."""

    __slots__ = (
        "__weakref__",  # the n-gram proposer keeps its index of a request weakly
        "arrival_time",
        "cache_salt",
        "eos_token_ids",
        "finish_reason",
        "finished_time",
        "first_scheduled_time",
        "first_token_time",
        "grammar",
        "hold_as",
        "images",
        "lora_request",
        "max_tokens",
        "num_accepted_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_draft_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "priority",
        "request_id",
        "sampling_params",
        "status",
        "stop_reason",
        "stop_token_ids",
        "tier_load_time",
        "tier_loaded_blocks",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        hold_as: str | None = None,
        lora_request: LoRARequest | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> None:
        self.request_id = request_id
        # Prompt followed by output tokens; never shrinks.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset() if sampling_params.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        # Effective output budget: the user's max_tokens, capped by the context window.
        room = max_model_len - self.num_prompt_tokens
        self.max_tokens = (
            room if sampling_params.max_tokens is None else min(sampling_params.max_tokens, room)
        )
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority  # lower value is served first (vLLM convention)
        self.cache_salt = cache_salt
        # When set, the finished request's KV blocks stay referenced under this holder id
        # (a session) instead of being freed, so the holder's next request hits them.
        self.hold_as = hold_as
        self.lora_request = lora_request  # the adapter it runs with; None: the base model
        # Its images' placeholder runs in the prompt (a vision-language model); their content
        # hashes key the prefix cache of the blocks they overlap.
        self.images = images
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Async scheduling: tokens steps in flight will sample for it, not back yet
        # (``core.placeholders``); always 0 under synchronous steps.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-hit tokens at first scheduling; -1 = not yet
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # speculative decoding: drafts verified, and accepted
        self.num_accepted_tokens = 0
        # KV tiers: blocks loaded back for it from the host/disk tiers, and the load's time
        # (scheduled to acknowledged, seconds; summed over its loads).
        self.tier_loaded_blocks = 0
        self.tier_load_time = 0.0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        # The output constraint's compile future / matcher (``structured.manager``).
        self.grammar: RequestGrammar | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def lora_int_id(self) -> int:
        """The adapter's id; 0: the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    def sort_key(self) -> tuple[int, float]:
        """Priority-policy order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
