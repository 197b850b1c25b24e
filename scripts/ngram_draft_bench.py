#!/usr/bin/env python3
"""Per-step cost of n-gram drafting for 64 rows: the whole-context scan (``find_draft``, the
proposer before issue 43's change) vs ``NgramIndex``, on the same token streams (the drafts
are asserted equal). Rows start at ``--prompt-len`` tokens and grow 1-4 tokens a step.

    .venv/bin/python scripts/ngram_draft_bench.py --prompt-len 32 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from tokenwire.runtime.core.spec.ngram import find_draft
from tokenwire.runtime.core.spec.ngram_index import NgramIndex

ROWS, STEPS, N_MIN, N_MAX, K = 64, 32, 1, 3, 3


def streams(prompt_len: int) -> list[list[int]]:
    rng = random.Random(0)
    length = prompt_len + 4 * STEPS
    return [
        [rng.randrange(1000) if rng.random() < 0.5 else 5 + (i + j) % 40 for j in range(length)]
        for i in range(ROWS)
    ]


def run(rows: list[list[int]], prompt_len: int, scan: bool) -> tuple[list[float], list[list[int]]]:
    """(seconds of each step, every draft in order)."""
    indexes = [NgramIndex(N_MIN, N_MAX) for _ in rows]
    lengths, rng = [prompt_len] * len(rows), random.Random(1)
    seconds: list[float] = []
    drafts: list[list[int]] = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        for row, index, length in zip(rows, indexes, lengths, strict=True):
            tokens = row[:length]
            if scan:
                drafts.append(find_draft(np.asarray(tokens, dtype=np.int64), N_MIN, N_MAX, K))
            else:
                drafts.append(index.draft(tokens, K))
        seconds.append(time.perf_counter() - t0)
        lengths = [n + rng.randint(1, 4) for n in lengths]
    return seconds, drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = streams(args.prompt_len)
    for _ in range(args.rounds):
        scan_s, scan_drafts = run(rows, args.prompt_len, scan=True)
        index_s, index_drafts = run(rows, args.prompt_len, scan=False)
        assert scan_drafts == index_drafts
        print(
            f"prompt {args.prompt_len}: scan {1e3 * statistics.median(scan_s[1:]):.3f} ms/step, "
            f"index {1e3 * statistics.median(index_s[1:]):.3f} ms/step "
            f"(first step, indexing the prompts: {1e3 * index_s[0]:.2f} ms)"
        )


if __name__ == "__main__":
    main()
