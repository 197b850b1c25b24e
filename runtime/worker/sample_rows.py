"""Sampling a step's rows: the logits of the rows that sample, in, their tokens out.

``sample_rows`` is a function of explicit inputs: the ``RowSampler`` (the stateless sampler,
the engine's generator for unseeded random rows, the vocabulary size and device), the
``InputBatch`` the sampled tokens are appended to, the rows' logits and their request states.
The model runner calls it for a plain step and the speculative verify step for the rows of a
verify step that have no drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenwire.runtime.model_output import TokenLogprobs
from tokenwire.runtime.sample.sampler import Sampler
from tokenwire.runtime.sample.sampling_metadata import build_sampling_metadata
from tokenwire.runtime.structured.bitmask import GrammarBitmask
from tokenwire.runtime.worker.grammar_mask import apply_grammar_bitmask
from tokenwire.runtime.worker.input_batch import InputBatch
from tokenwire.runtime.worker.request_state import CachedRequestState


@dataclass(frozen=True)
class RowSampler:
    """What sampling needs besides the rows: ``generator`` draws for unseeded random rows
    (seeded rows carry their own); ``vocab_size`` and ``device`` shape the metadata."""

    sampler: Sampler
    generator: torch.Generator
    vocab_size: int
    device: torch.device


@dataclass(slots=True)
class StepTokens:
    """What one step's rows emitted, in order: ``req_ids[i]`` sampled ``token_ids[i]``; a
    verified row's further tokens (accepted drafts, then the bonus or corrected token) and
    their logprobs are in ``extra_token_ids`` / ``extra_logprobs``."""

    req_ids: list[str]
    token_ids: list[int]
    logprobs: dict[str, TokenLogprobs]
    extra_token_ids: dict[str, list[int]] = field(default_factory=dict)
    extra_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


def sample_rows(
    sampling: RowSampler,
    batch: InputBatch,
    logits: torch.Tensor,
    states: list[CachedRequestState],
    rows: np.ndarray,
    bitmask: GrammarBitmask | None = None,
) -> StepTokens:
    """Sample one token per row of ``logits`` (row ``i`` is ``states[i]`` in batch row
    ``rows[i]``), append it to the row and the request, report the logprobs asked for."""
    if not states:
        return StepTokens([], [], {})
    if bitmask is not None:  # constrained rows only; the sampler sees masked logits
        logits = logits.float()
        row_of = {s.request_id: i for i, s in enumerate(states)}
        apply_grammar_bitmask(logits, row_of, bitmask)
    meta = build_sampling_metadata(
        [s.sampling for s in states], sampling.vocab_size, sampling.device, sampling.generator
    )
    result = sampling.sampler(logits, meta)
    tokens: list[int] = result.sampled_token_ids.tolist()  # the step's one host sync
    req_ids = [s.request_id for s in states]
    batch.append_tokens(rows, tokens)
    for state, token in zip(states, tokens, strict=True):
        state.output_token_ids.append(token)
    logprobs: dict[str, TokenLogprobs] = {}
    if result.logprobs is not None:
        rows_lps = result.logprobs.rows([s.params.logprobs for s in states])
        for state, entry in zip(states, rows_lps, strict=True):
            if entry is not None:
                logprobs[state.request_id] = entry
    return StepTokens(req_ids, tokens, logprobs)
