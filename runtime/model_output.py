"""Plain-data seam from the executor back to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs at one position: the chosen token first, then the top-k alternatives.

    ``token_ids[0]``/``logprobs[0]`` are the chosen token; ``rank`` is its 1-based rank in the
    model's distribution. Logprobs are log-softmax of the raw logits (before temperature,
    penalties and filtering), as vLLM's default ``raw_logprobs``.
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass(frozen=True, slots=True)
class ModelOutput:
    """What one forward + sample produced.

    ``req_ids[i]`` sampled ``sampled_token_ids[i]``. Requests in the middle of a chunked prefill
    sample nothing and do not appear. ``logprobs`` only holds requests that asked for them.
    ``prompt_logprobs`` holds, per request that asked, the positions computed this step
    (position 0 of the prompt has no logprob and is reported as ``None``).
    """

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    # Wall time of the forward pass and of sampling, in seconds (for step stats).
    forward_time: float = 0.0
    sample_time: float = 0.0
    prepare_time: float = 0.0
    # Tensor parallelism: rank 0's wall time in the step's collectives (part of forward).
    collective_time: float = 0.0
    # Speculative decoding: tokens a request emitted after ``sampled_token_ids[i]`` in the same
    # step: the rest of its accepted drafts, then the bonus or corrected token.
    extra_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # ... and their logprobs, for requests that asked (one per extra token, in order).
    extra_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Embedding requests whose last prompt chunk ran this step: their pooled vectors (they
    # sample nothing and are not in ``req_ids``).
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # KV tiers: ids of the host-tier loads (``KVLoad.load_id``) finished by now.
    kv_loads_done: list[int] = field(default_factory=list)
    # ... and the device blocks of those loads whose disk record was corrupt, truncated or not
    # this model's (ignored, never served: the connector does not cache them).
    kv_load_failed: list[int] = field(default_factory=list)
    # Image inputs: distinct images the vision encoder ran on this step, and its seconds
    # (part of ``prepare_time``).
    num_images_encoded: int = 0
    encoder_time: float = 0.0
