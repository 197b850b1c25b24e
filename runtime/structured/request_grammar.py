"""One constrained request's grammar state (``RequestGrammar``), held by its ``Request``.

Its own module, below both the scheduler's ``Request`` and the ``StructuredOutputManager``
that creates and advances it, so the request does not name the manager.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class RequestGrammar:
    """One request's constraint: a compile future, then a matcher (``ready``)."""

    __slots__ = ("deadline", "future", "matcher", "rejected")

    def __init__(self, future: Future[Any], deadline: float) -> None:
        self.future = future
        self.deadline = deadline
        self.matcher: Any = None  # xgrammar.GrammarMatcher once compiled
        self.rejected = False  # a sampled token the grammar did not accept (never expected)

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def accept(self, token: int) -> bool:
        """Advance with a sampled token; False (and ``rejected``) when it does not fit."""
        if not self.matcher.accept_token(token):
            self.rejected = True
        return not self.rejected

    @property
    def terminated(self) -> bool:
        """The grammar is complete and took its stop token (or needs none)."""
        return bool(self.matcher.is_terminated())
