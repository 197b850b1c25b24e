"""The n-gram proposer's incremental index proposes exactly what the whole-context scan
(``find_draft``) proposes: on random token streams that grow a token or a few at a time (as
decoding and accepted drafts grow them), with repeats, short contexts and every
``prompt_lookup_min`` / ``prompt_lookup_max`` / ``k`` mix."""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest

from tokenwire.runtime.config import SpeculativeConfig
from tokenwire.runtime.core.request import Request
from tokenwire.runtime.core.spec.ngram import NgramProposer, find_draft
from tokenwire.runtime.core.spec.ngram_index import NgramIndex
from tokenwire.runtime.sampling_params import SamplingParams

LOOKUPS = [(1, 1), (1, 3), (2, 2), (2, 5), (3, 3), (1, 6), (4, 7)]


def _stream(rng: random.Random, vocab: int, length: int) -> list[int]:
    """Random tokens, with copied runs of earlier tokens mixed in (what prompt lookup finds)."""
    tokens: list[int] = []
    while len(tokens) < length:
        if tokens and rng.random() < 0.4:
            start = rng.randrange(len(tokens))
            tokens.extend(tokens[start : start + rng.randint(1, 8)])
        else:
            tokens.append(rng.randrange(vocab))
    return tokens[:length]


def _reference(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    return find_draft(np.asarray(tokens, dtype=np.int64), n_min, n_max, k)


@pytest.mark.parametrize(("n_min", "n_max"), LOOKUPS)
@pytest.mark.parametrize("vocab", [2, 5, 50, 5000])
def test_index_equals_the_scan_as_tokens_grow(n_min: int, n_max: int, vocab: int) -> None:
    rng = random.Random(1000 * n_min + 10 * n_max + vocab)
    drafted = 0
    for _ in range(8):
        stream = _stream(rng, vocab, rng.randint(1, 160))
        index = NgramIndex(n_min, n_max)
        # Start short (contexts shorter than n_max) or with a prompt; grow by a token, by
        # accepted drafts, or by many at once (the index's bulk path).
        length = rng.choice([0, 1, 2, 3, 4, 40])
        while length <= len(stream):
            tokens, k = stream[:length], rng.randint(1, 6)
            expected = _reference(tokens, n_min, n_max, k)
            assert index.draft(tokens, k) == expected, (tokens, n_min, n_max, k)
            drafted += bool(expected)
            length += rng.choice([1, 1, 1, 2, 4, 17, 30])
    assert drafted > 0  # the streams do exercise matches


def test_repeats_and_tiny_contexts() -> None:
    cases = [
        ([], 1, 3, 2),
        ([7], 1, 3, 2),
        ([3, 3], 1, 1, 4),
        ([3, 3, 3], 2, 2, 4),
        ([3, 3, 3, 3, 3, 3], 1, 4, 3),
        ([4, 5, 6, 4, 5], 1, 3, 5),
        ([1, 2, 3, 4], 1, 3, 2),
        ([1, 2, 7, 8, 2, 1, 2], 1, 3, 3),
        ([9, 1, 2, 9, 1, 3, 9, 1], 2, 2, 5),
    ]
    for tokens, n_min, n_max, k in cases:
        assert NgramIndex(n_min, n_max).draft(tokens, k) == _reference(tokens, n_min, n_max, k)


def test_a_list_that_is_not_the_indexed_one_starts_over() -> None:
    index = NgramIndex(1, 3)
    first = [1, 2, 3, 1, 2, 3, 1, 2]
    assert index.draft(first, 3) == _reference(first, 1, 3, 3) == [3, 1, 2]
    shorter = [5, 6, 5]
    assert index.draft(shorter, 2) == _reference(shorter, 1, 3, 2) == [6, 5]
    other = [1, 2, 4, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2]  # same length as before, other tokens
    assert index.draft(other, 3) == _reference(other, 1, 3, 3)


def _request(prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request("r", prompt, params, frozenset(), 4096)


def test_proposer_drafts_like_the_scan_and_forgets_finished_requests() -> None:
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
    proposer = NgramProposer(config, max_model_len=4096)
    rng = random.Random(7)
    stream = _stream(rng, 20, 200)
    request = _request(stream[:40], max_tokens=500)
    for token in stream[40:]:
        expected = _reference(request.token_ids, 2, 4, 3)
        assert proposer.propose(request, budget=16) == expected
        request.token_ids.append(token)
    # A budget of 2 leaves room for one draft.
    assert proposer.propose(request, budget=2) == _reference(request.token_ids, 2, 4, 1)
    assert len(proposer._indexes) == 1
    del request
    gc.collect()
    assert len(proposer._indexes) == 0  # the index goes with its request
