"""Exact verification of draft tokens against the target model (vLLM's rejection sampler).

A request with ``k`` drafts is scored at ``k + 1`` positions in one forward: position ``j``
gives the target's distribution ``p_j`` for the token after ``d_1 .. d_j``.

- Greedy rows accept drafts while ``d_j == argmax p_j``, then add ``argmax p_a`` at the first
  mismatch ``a`` (or after the last draft): exactly the tokens plain greedy decoding makes.
- Random rows (n-gram drafts put all their mass on ``d_j``) accept ``d_j`` with probability
  ``p_j(d_j)``; at the first rejection they sample from ``p_j`` with ``d_j`` removed
  (renormalised), and when every draft is accepted they sample a bonus token from ``p_k``:
  each emitted token follows the target's distribution (temperature, top-k, top-p, min-p,
  logit bias, penalties and the min_tokens mask applied as in the plain sampler; position
  ``j`` sees ``d_1 .. d_j`` as output tokens). A seeded request draws its uniforms and
  its exponential noise from its own generator, so it is reproducible.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from tokenwire.runtime.sample.sampler import apply_logits_processors, random_probs
from tokenwire.runtime.sample.sampling_metadata import RowSamplingState, build_sampling_metadata

_MIN_NOISE = torch.finfo(torch.float32).tiny


def verify_drafts(
    logits: torch.Tensor,
    rows: Sequence[RowSamplingState],
    drafts: Sequence[list[int]],
    vocab_size: int,
    generator: torch.Generator | None,
) -> list[list[int]]:
    """``logits`` [sum(len(d) + 1), V]: each row's ``len(d) + 1`` positions in order.
    Returns the tokens each row emits this step (accepted drafts + one more)."""
    counts = [len(d) + 1 for d in drafts]
    expanded = [
        _at_position(row, draft, j)
        for row, draft in zip(rows, drafts, strict=True)
        for j in range(len(draft) + 1)
    ]
    meta = build_sampling_metadata(expanded, vocab_size, logits.device, generator)
    processed = apply_logits_processors(logits.float(), meta)
    greedy_ids: list[int] = processed.argmax(dim=-1).tolist()
    probs = None if meta.all_greedy else random_probs(processed, meta)
    out: list[list[int]] = []
    start = 0
    for row, draft, count in zip(rows, drafts, counts, strict=True):
        if row.params.greedy or probs is None:
            out.append(_greedy(greedy_ids[start : start + count], draft))
        else:
            out.append(_rejection(probs[start : start + count], draft, row, generator))
        start += count
    return out


def _at_position(row: RowSamplingState, draft: list[int], j: int) -> RowSamplingState:
    """The row as sampled after ``draft[:j]`` were accepted: penalties and the min_tokens
    mask see those tokens as output, exactly as plain decoding would."""
    if j == 0 or row.params.is_plain_greedy:
        return row
    return dataclasses.replace(row, output_token_ids=[*row.output_token_ids, *draft[:j]])


def _greedy(targets: list[int], draft: list[int]) -> list[int]:
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return [*draft[:accepted], targets[accepted]]


def _rejection(
    probs: torch.Tensor,
    draft: list[int],
    row: RowSamplingState,
    default: torch.Generator | None,
) -> list[int]:
    generator = row.generator if row.generator is not None else default
    k = len(draft)
    draft_ids = torch.tensor(draft, dtype=torch.long, device=probs.device)
    p_draft = probs[torch.arange(k, device=probs.device), draft_ids]
    uniforms = torch.rand(k, generator=generator, device=probs.device)
    accept: list[bool] = (uniforms < p_draft).tolist()
    accepted = 0
    while accepted < k and accept[accepted]:
        accepted += 1
    final = probs[accepted].clone()
    if accepted < k:  # the residual max(p - q, 0) of a one-hot q: p without the draft token
        final[draft[accepted]] = 0.0
        if not bool(final.sum() > 0):  # p was all on the draft token: cannot happen when
            final = probs[accepted].clone()  # rejected, but keep a valid distribution
    noise = torch.empty_like(final).exponential_(generator=generator).clamp_min_(_MIN_NOISE)
    return [*draft[:accepted], int(final.div_(noise).argmax())]
