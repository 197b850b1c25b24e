"""What the model runner remembers about one request between steps (``CachedRequestState``).

Its own module so that the runner's helpers below it (sampling rows, prompt logprobs, the
speculative verify step and draft model) can name it without importing the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.runtime.sample.sampling_metadata import RowSamplingState
from tokenwire.runtime.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    """What the runner remembers about a request between steps."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    sampling: RowSamplingState
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model
    row: int | None = None  # None while preempted
    # Next prompt position whose logprob is still unreported (a recompute after preemption
    # must not report positions twice).
    next_prompt_logprob: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
