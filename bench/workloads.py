"""Benchmark workloads (DESIGN §9), generated deterministically from Python's ``random``."""

from __future__ import annotations

import random
from dataclasses import dataclass

WORKLOADS = ("fixed", "mixed", "cpu")


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(name: str, vocab_size: int, num_requests: int | None = None) -> Workload:
    """Build a workload; token ids are clipped into the model's vocabulary.

    ``mixed`` reproduces nano-vllm's benchmark exactly (prompt tokens sum to 142,827 and
    output tokens to 133,966 for the default 256 requests).
    """
    rng = random.Random(0)
    max_id = min(10000, vocab_size - 1)
    if name == "mixed":
        n = num_requests or 256
        prompts = [
            [rng.randint(0, max_id) for _ in range(rng.randint(100, 1024))] for _ in range(n)
        ]
        output_lens = [rng.randint(100, 1024) for _ in range(n)]
    elif name == "fixed":
        n = num_requests or 256
        prompts = [[rng.randint(0, max_id) for _ in range(512)] for _ in range(n)]
        output_lens = [128] * n
    elif name == "cpu":
        n = num_requests or 64
        prompts = [[rng.randint(0, max_id) for _ in range(rng.randint(32, 256))] for _ in range(n)]
        output_lens = [rng.randint(32, 128) for _ in range(n)]
    else:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    return Workload(name, prompts, output_lens)
