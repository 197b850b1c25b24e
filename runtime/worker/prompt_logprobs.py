"""Prompt logprobs for one prefill chunk: the logprob of each prompt token given its prefix."""

from __future__ import annotations

import torch

from tokenwire.runtime.model_output import TokenLogprobs


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
