"""The scheduler's side of ``draft_model`` speculation, and the choice of proposer.

With a draft model the drafts are made on the workers (``draft_model``), inside the step that
verifies them, so the scheduler only decides how many each decoding request gets: it
schedules ``1 + k`` tokens with ``k`` placeholder drafts (budget, KV slots and the
acceptance bookkeeping count them as drafts). The workers overwrite the placeholders with the
draft model's greedy proposals before the target's forward.
"""

from __future__ import annotations

from typing import Protocol

from tokenwire.runtime.config import SpeculativeConfig
from tokenwire.runtime.core.request import Request
from tokenwire.runtime.core.spec.ngram import NgramProposer, draft_room

# Written where a worker-made draft goes; never reaches a model (the workers replace it).
PLACEHOLDER_TOKEN = 0


class Proposer(Protocol):
    def active(self, num_running: int) -> Proposer | None: ...

    def propose(self, request: Request, budget: int) -> list[int]: ...


class DraftModelSlots:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def active(self, num_running: int) -> DraftModelSlots | None:
        """Itself, unless ``num_running`` reaches ``disable_by_batch_size``."""
        limit = self.config.disable_by_batch_size
        return self if limit is None or num_running < limit else None

    def propose(self, request: Request, budget: int) -> list[int]:
        """``k`` placeholders for the worker's draft model (``ngram.draft_room`` bounds k)."""
        # Structured-output requests get none: their drafts would have to be cut to the
        # grammar here, and the workers make them.
        room = draft_room(self.config, self.max_model_len, request, budget, grammar_ok=False)
        return [PLACEHOLDER_TOKEN] * max(room, 0)


def make_proposer(config: SpeculativeConfig | None, max_model_len: int) -> Proposer | None:
    """The scheduler's proposer for ``--speculative-config`` (None: no speculation)."""
    if config is None:
        return None
    if config.method == "draft_model":
        return DraftModelSlots(config, max_model_len)
    return NgramProposer(config, max_model_len)
