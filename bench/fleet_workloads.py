"""Fleet workloads of ``tokenwire bench serve`` (issue 28): traffic whose speed depends on which
replica a request lands on, because its prefix is cached on one of them.

- ``multiturn``: conversations of several turns; each turn's prompt is the whole transcript so
  far (the previous prompt, the assistant's answer, a new user message). Turns of one
  conversation run one after the other; conversations run concurrently. Every call of a
  conversation carries its session id (``x-session-id``), the routing key a gateway's
  affinity policy reads.
- ``shared-prefix``: many one-turn requests sharing a few long system prompts.

The assistant's answers in a transcript are fixed random tokens, not what the model said: the
prompts are then the same whichever replica (and routing policy) served the turn before, so two
policies are compared on identical requests. A real client appends the model's own answer,
which a replica has cached too (its generated blocks); this workload measures only the prompt
prefix reuse, a lower bound of what affinity saves.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FLEET_WORKLOADS = ("multiturn", "shared-prefix")


@dataclass(frozen=True)
class Turn:
    prompt: list[int]
    output_len: int


@dataclass(frozen=True)
class Conversation:
    session_id: str
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class FleetShape:
    """Sizes of the fleet workloads (defaults sized for a 2-core CPU box)."""

    conversations: int = 24
    turns: int = 4
    first_prompt: int = 256  # multiturn: tokens of a conversation's first message
    user_message: int = 48  # tokens each later turn's user message adds
    output_len: int = 24  # tokens each turn generates (and its answer adds to the transcript)
    system_prompts: int = 4  # shared-prefix: distinct system prompts
    system_len: int = 384  # shared-prefix: tokens of each system prompt
    suffix_len: int = 32  # shared-prefix: tokens of each request's own question

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "first_prompt", "output_len", "system_prompts"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")


def make_fleet_workload(
    name: str, vocab_size: int, shape: FleetShape, num_requests: int | None = None
) -> list[Conversation]:
    """The conversations of a fleet workload, from ``random.Random(0)``; token ids below
    ``min(10000, vocab_size)``. ``num_requests`` overrides the conversation count."""
    rng = random.Random(0)
    max_id = min(10000, vocab_size - 1)

    def tokens(n: int) -> list[int]:
        return [rng.randint(0, max_id) for _ in range(n)]

    count = num_requests or shape.conversations
    if name == "multiturn":
        conversations = []
        for c in range(count):
            transcript = tokens(shape.first_prompt)
            turns = [Turn(list(transcript), shape.output_len)]
            for _ in range(shape.turns - 1):
                transcript += tokens(shape.output_len) + tokens(shape.user_message)
                turns.append(Turn(list(transcript), shape.output_len))
            conversations.append(Conversation(f"conv-{c}", tuple(turns)))
        return conversations
    if name == "shared-prefix":
        systems = [tokens(shape.system_len) for _ in range(shape.system_prompts)]
        return [
            Conversation(
                f"req-{i}",
                (Turn(systems[i % len(systems)] + tokens(shape.suffix_len), shape.output_len),),
            )
            for i in range(count * shape.turns)
        ]
    raise ValueError(f"fleet workload must be one of {', '.join(FLEET_WORKLOADS)}; got {name!r}")
