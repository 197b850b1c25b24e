"""Plain-data seam from the scheduler to the executor (vLLM v1 shape).

The executor keeps its own per-request state (token ids, block table row, sampling state), so
only what changed crosses the seam: new requests in full, running ones as diffs. Rows of the
forward batch follow the insertion order of ``num_scheduled_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenwire.runtime.kv_transfer import KVTransferPlan
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.runtime.multimodal import ImageInput
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.structured.bitmask import GrammarBitmask

# Block tables are padded with the null block, which is never allocated to a request. The
# kernels read it harmlessly and define the same id (``kernels/kv_layout.py``; kernels import
# nothing of the runtime); ``tests/project/test_layering.py`` checks the two agree.
NULL_BLOCK_ID = 0


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the executor has not seen before (first scheduling)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-hit tokens already in the cache
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base
    images: tuple[ImageInput, ...] = ()  # its images (a vision-language model), by position


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """Block-table diffs for requests the executor already holds state for (parallel lists).

    Only requests whose table changed this step appear: for one resumed from preemption,
    ``new_block_ids`` is its whole new block list and replaces the old one, and
    ``num_computed_tokens`` is its prefix hit; otherwise ``new_block_ids`` holds the blocks
    appended this step. A running request with an unchanged table is absent: the executor
    advances its own ``num_computed_tokens`` by the scheduled tokens after every step.
    """

    request_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    step_id: int
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    # request_id -> tokens to compute this step; insertion order is the batch row order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Prompt tokens (prefill) and generated-token (decode) work in this step, for stats.
    num_prefill_tokens: int
    num_decode_tokens: int
    # Finished or aborted since the previous step: the executor drops their state.
    finished_req_ids: frozenset[str]
    # Preempted in this step: the executor releases their rows but keeps sampling state.
    preempted_req_ids: frozenset[str]
    # Allowed tokens of the constrained requests that sample this step; None: there are none.
    grammar_bitmask: GrammarBitmask | None = None
    # Unloaded adapters no request uses any more: the workers drop them.
    removed_lora_ids: frozenset[int] = frozenset()
    # Speculative decoding: request_id -> draft tokens scheduled after its last token (its
    # ``num_scheduled_tokens`` counts them); the runner verifies them.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # KV tiers: this step's host-tier copies; None when off or nothing to move.
    kv_transfers: KVTransferPlan | None = None
    # Image inputs (``core.encoder_cache``): request_id -> indices of its images the worker
    # encodes this step (each content hash once); content hashes the worker's encoder cache
    # drops first; images whose cached features this step reads instead of encoding.
    encoder_inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    encoder_frees: tuple[str, ...] = ()
    num_encoder_cache_hits: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
