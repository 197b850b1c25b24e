"""Prompt logprobs: the logprob of each prompt token given its prefix, per prefill chunk.

``prompt_logprobs_for_step`` is a function of explicit inputs: the step's request states and
host arrays, its hidden states and the model's logits function (``compute_logits``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenwire.runtime.model_output import TokenLogprobs
from tokenwire.runtime.worker.input_batch import StepArrays
from tokenwire.runtime.worker.request_state import CachedRequestState


def prompt_logprobs_for_step(
    states: list[CachedRequestState],
    a: StepArrays,
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, list[TokenLogprobs | None]]:
    """The prompt positions this step computed for each request that asked (``states[i]`` is
    batch row ``i`` of ``a``); positions reported before (a recompute) are left out."""
    out: dict[str, list[TokenLogprobs | None]] = {}
    for i, state in enumerate(states):
        k = state.params.prompt_logprobs
        if k is None:
            continue
        q0, q1 = int(a.query_start_loc[i]), int(a.query_start_loc[i + 1])
        start = int(a.seq_lens[i]) - (q1 - q0)
        # This chunk reports prompt positions first..last (0 has no logprob: None).
        first = 0 if start == 0 else start + 1
        last = min(start + q1 - q0, len(state.prompt_token_ids) - 1)
        if last < state.next_prompt_logprob:
            continue  # nothing new (decode, or a recomputed stretch)
        entries = prompt_logprobs_for_chunk(
            compute_logits(hidden[q0:q1]), state.prompt_token_ids, start, k
        )
        out[state.request_id] = entries[max(0, state.next_prompt_logprob - first) :]
        state.next_prompt_logprob = last + 1
    return out


def prompt_logprobs_for_chunk(
    logits: torch.Tensor, prompt_token_ids: list[int], start: int, num_top: int
) -> list[TokenLogprobs | None]:
    """``logits[j]`` is the model output at position ``start + j`` (it predicts ``start+j+1``).

    Returns one entry per prompt position covered by this chunk whose token has a predecessor:
    position 0 has none and is reported as ``None`` (only by the chunk starting at 0).
    """
    num_prompt = len(prompt_token_ids)
    stop = min(start + logits.shape[0], num_prompt - 1)  # last position with a prompt target
    out: list[TokenLogprobs | None] = [None] if start == 0 else []
    if stop <= start:
        return out
    logprobs = torch.log_softmax(logits[: stop - start].float(), dim=-1)
    targets = torch.tensor(prompt_token_ids[start + 1 : stop + 1], device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_lp, top_ids = (
        logprobs.topk(num_top, dim=-1) if num_top else (chosen[:, :0], targets[:, None][:, :0])
    )
    ids = torch.cat([targets[:, None], top_ids], dim=1).tolist()
    lps = torch.cat([chosen, top_lp], dim=1).tolist()
    out.extend(TokenLogprobs(i, lp, r) for i, lp, r in zip(ids, lps, ranks.tolist(), strict=True))
    return out
