"""Prompt-lookup (n-gram) drafts, proposed by the scheduler (no torch).

The longest suffix of ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens that also
occurs earlier in the request's tokens (prompt + output) proposes the tokens that followed
its most recent earlier occurrence, up to ``num_speculative_tokens``.

A request that wants logprobs gets them for every emitted token (from the verifying
forward's scores at its position). A structured-output request's drafts are cut to what its
grammar accepts and verified against per-position masks (``grammar_drafts``). Everything
else — temperature, top-k, top-p, min-p, logit bias, penalties, min_tokens, seeds, stop
conditions — is verified exactly (``verify``).
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenwire.runtime.config import SpeculativeConfig
from tokenwire.runtime.core.request import Request
from tokenwire.runtime.core.spec.grammar_drafts import grammar_prefix
from tokenwire.runtime.core.spec.ngram_index import NgramIndex


def find_draft(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    matching suffix (``n_max`` .. ``n_min`` tokens); [] when none occurs. A scan of the whole
    context: the reference for ``NgramIndex``, which the proposer uses."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in tokens[start : start + k]]
    return []


def eligible(request: Request, grammar_ok: bool = True) -> bool:
    """May this request's next tokens be drafted (see the module docstring)? ``grammar_ok``:
    whether the proposer can cut drafts to a grammar (it must know them: not so for the
    workers' draft model)."""
    return grammar_ok or request.grammar is None


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # Each running request's index, dropped with the request (tokens only grow).
        self._indexes: WeakKeyDictionary[Request, NgramIndex] = WeakKeyDictionary()

    def active(self, num_running: int) -> NgramProposer | None:
        """Itself, unless ``num_running`` reaches ``disable_by_batch_size``."""
        limit = self.config.disable_by_batch_size
        return self if limit is None or num_running < limit else None

    def propose(self, request: Request, budget: int) -> list[int]:
        """Drafts for a running request in decode (its last token not yet computed), at most
        ``budget - 1`` of them and never past its ``max_tokens`` or the context length."""
        room = draft_room(self.config, self.max_model_len, request, budget)
        if room <= 0:
            return []
        index = self._indexes.get(request)
        if index is None:
            cfg = self.config
            index = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            self._indexes[request] = index
        return grammar_prefix(request, index.draft(request.token_ids, room))


def draft_room(
    config: SpeculativeConfig,
    max_model_len: int,
    request: Request,
    budget: int,
    grammar_ok: bool = True,
) -> int:
    """How many drafts a decoding request may take this step: at most ``budget - 1`` and
    ``num_speculative_tokens``, never past its ``max_tokens`` or the context length; 0 for a
    request that is not ``eligible``."""
    if not eligible(request, grammar_ok):
        return 0
    return min(
        budget - 1,
        config.num_speculative_tokens,
        request.max_tokens - request.num_output_tokens - 1,
        max_model_len - request.num_tokens - 1,
    )
