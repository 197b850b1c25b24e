"""DeepSeekMoE's grouped top-k router (torch; every device), as HF's ``DeepseekV2TopkRouter``
and ``DeepseekV3TopkRouter`` compute it."""

from __future__ import annotations

import torch


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    *,
    sigmoid: bool,
    group_top2_sum: bool,
    renormalize: bool,
    routed_scaling_factor: float,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (float32 weights [T, k], int64 expert ids [T, k]).

    Scores are ``softmax`` (V2) or ``sigmoid`` (V3) of the float32 logits; the choice adds
    ``correction_bias`` (V3's ``e_score_correction_bias``) and keeps only the experts of the
    ``topk_groups`` best of ``num_groups`` equal groups (ranked by their best choice score,
    or the sum of their best two with ``group_top2_sum``); the chosen experts' unbiased
    scores, renormalised to sum to 1 when ``renormalize``, times ``routed_scaling_factor``.
    """
    logits = router_logits.float()
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        grouped = choice.view(choice.shape[0], num_groups, -1)
        if group_top2_sum:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape_as(choice)
        # V3 masks the choice with -inf; V2 zeroes the masked scores (its weights too).
        choice = choice.masked_fill(~keep, float("-inf") if sigmoid else 0.0)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = (scores if sigmoid else choice).gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids
