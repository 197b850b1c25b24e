"""Speculation under a structured-output grammar (scheduler side, no torch).

A constrained request's drafts are cut at the first token its grammar would not accept
(``grammar_prefix``), and its step bitmask gets one row per scored position
(``fill_draft_rows``): the allowed tokens before each draft and after the last, each the
matcher's state after the drafts before it. The matcher is rolled back afterwards, so only
verified tokens ever advance it (``Scheduler.update`` accepts them one by one). Each row
masks the logits the verifier reads at its position, so greedy rows keep exactly the
constrained tokens of plain decoding and sampled rows draw from the masked distribution.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenwire.runtime.core.request import Request


def grammar_prefix(request: Request, draft: list[int]) -> list[int]:
    """The longest prefix of ``draft`` that ``request``'s grammar accepts, ending at a token
    that completes it (nothing can follow); the matcher is left as it was."""
    grammar = request.grammar
    if grammar is None or not draft:
        return draft
    matcher = grammar.matcher
    n = 0
    for token in draft:
        if not matcher.accept_token(token):
            break
        n += 1
        if matcher.is_terminated():
            break
    if n:
        matcher.rollback(n)
    return draft[:n]


def fill_draft_rows(matcher: Any, draft: list[int], array: np.ndarray, row: int) -> None:
    """Rows ``row .. row + len(draft)`` of ``array``: the tokens allowed at each scored
    position. After a completing token every token is allowed: that position is never
    sampled (the stop token ends the request), and an all-masked row would not be a
    distribution."""
    matcher.fill_next_token_bitmask(array, row)
    for j, token in enumerate(draft, start=1):
        accepted = matcher.accept_token(token)
        assert accepted, "drafts are cut to the grammar's prefix when proposed"
        if matcher.is_terminated():
            array[row + j] = -1
        else:
            matcher.fill_next_token_bitmask(array, row + j)
    if draft:
        matcher.rollback(len(draft))
