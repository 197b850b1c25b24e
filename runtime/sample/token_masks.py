"""Token masks of a batch: ``allowed_token_ids`` (a whitelist) and ``bad_words`` (banned
continuations), both applied as ``-inf`` logits before anything else processes them.

``bad_words`` follow vLLM: each request carries token-id sequences (its words tokenized by the
front, ``sample/bad_words.py``); a sequence's last token is banned at a step whenever the
request's OUTPUT so far ends with the sequence's other tokens, and always when it has one
token. Under speculative decoding the verifier sees each position's accepted drafts as output
(``rejection._at_position``), so a draft that would complete a bad word is never accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenwire.runtime.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class BannedTokens:
    """(row, token) pairs forced to ``-inf`` this step (bad words' banned last tokens)."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64


@dataclass(frozen=True)
class AllowedTokens:
    """Rows with an ``allowed_token_ids`` whitelist and, per such row, the tokens it may
    NOT sample (True = masked)."""

    rows: torch.Tensor  # [R] int64
    disallowed: torch.Tensor  # [R, V] bool


def allowed_tokens(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> AllowedTokens | None:
    """The whitelist masks of the rows that have one; None when no row does."""
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return None
    disallowed = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)
    row_idx: list[int] = []
    token_idx: list[int] = []
    for r, i in enumerate(rows):
        for token in params[i].allowed_token_ids or ():
            row_idx.append(r)
            token_idx.append(token)
    disallowed[_longs(row_idx, device), _longs(token_idx, device)] = False
    return AllowedTokens(_longs(rows, device), disallowed)


def banned_by_bad_words(
    bad_words: Sequence[tuple[tuple[int, ...], ...]],
    outputs: Sequence[Sequence[int]],
    device: torch.device,
) -> BannedTokens | None:
    """Per row, the last token of each bad-word sequence whose prefix ends the row's output
    (every single-token sequence); None when nothing is banned."""
    rows: list[int] = []
    tokens: list[int] = []
    for i, (sequences, output) in enumerate(zip(bad_words, outputs, strict=True)):
        banned: set[int] = set()
        for ids in sequences:
            prefix = ids[:-1]
            if len(prefix) <= len(output) and (
                not prefix or tuple(output[len(output) - len(prefix) :]) == prefix
            ):
                banned.add(ids[-1])
        for token in sorted(banned):  # sorted: tensors independent of set order
            rows.append(i)
            tokens.append(token)
    if not rows:
        return None
    return BannedTokens(_longs(rows, device), _longs(tokens, device))


def apply_token_masks_(
    logits: torch.Tensor, allowed: AllowedTokens | None, banned: BannedTokens | None
) -> None:
    """In place on ``logits`` [B, V] (the caller's own copy)."""
    if allowed is not None:
        rows = logits.index_select(0, allowed.rows).masked_fill_(allowed.disallowed, _NEG_INF)
        logits.index_copy_(0, allowed.rows, rows)
    if banned is not None:
        logits[banned.rows, banned.token_ids] = _NEG_INF


def _longs(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
