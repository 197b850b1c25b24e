"""An incremental n-gram index of one request's tokens, for prompt-lookup drafts (no torch).

``ngram.find_draft`` scans the whole context for each suffix length at every step (a few
numpy passes per row: ~50-60 us a row at ~100 tokens, most of the scheduler's time with
n-gram speculation at 64 rows). The index maps every n-gram (``n_min`` .. ``n_max``
tokens) that ends before the last token to the start of its latest occurrence, and takes
only the tokens appended since the previous step; a lookup is then at most
``n_max - n_min + 1`` dict probes. It proposes exactly what ``find_draft`` proposes
(tests/runtime/test_ngram_index.py compares them).

A request's tokens only grow (output tokens and accepted drafts are appended; preemption
keeps them), so the index is extended, never rebuilt; should the list be shorter than what
was indexed, or its token at the last indexed position differ, the index starts over.
Memory: about ``n_max - n_min + 1`` dict entries (small tuples) per token of the request.
"""

from __future__ import annotations

# Up to this many new tokens are indexed with a plain loop, more with ``zip`` (cheaper per
# n-gram, dearer to set up).
_FEW = 16


class NgramIndex:
    """The latest start of each ``n_min`` .. ``n_max`` token n-gram of a token list that ends
    before its last token, kept up to date by ``draft``."""

    __slots__ = ("latest", "n_max", "n_min", "seen", "tail")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self.latest: dict[tuple[int, ...], int] = {}
        self.seen = 0  # n-grams ending (exclusive) at positions <= seen are indexed
        self.tail = -1  # tokens[seen - 1] when indexed (-1: nothing indexed)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        matching suffix of ``tokens`` (``n_max`` .. ``n_min`` tokens); [] when none occurs."""
        self._extend(tokens)
        length = len(tokens)
        latest = self.latest
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            start = latest.get(tuple(tokens[length - n :]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []

    def _extend(self, tokens: list[int]) -> None:
        """Index the n-grams that end (exclusive) at ``seen + 1`` .. ``len(tokens) - 1``."""
        stop = len(tokens) - 1
        if stop < self.seen or (self.seen and tokens[self.seen - 1] != self.tail):
            self.latest.clear()  # not the list that was indexed: start over
            self.seen = 0
        latest, n_min, n_max = self.latest, self.n_min, self.n_max
        if stop - self.seen <= _FEW:  # a decode step's tokens: a plain loop is cheapest
            for end in range(max(self.seen + 1, n_min), stop + 1):
                for n in range(n_min, min(n_max, end) + 1):
                    latest[tuple(tokens[end - n : end])] = end - n
        else:  # a prompt: build the tuples in C
            for n in range(n_min, n_max + 1):
                # The n-grams starting at first .. last, in order (a later start overwrites).
                first, last = max(self.seen + 1 - n, 0), stop - n
                if last >= first:
                    grams = zip(*(tokens[first + j : last + 1 + j] for j in range(n)), strict=True)
                    latest.update(zip(grams, range(first, last + 1), strict=True))
        if stop > self.seen:
            self.seen = stop
            self.tail = tokens[stop - 1]
