"""``bad_words`` -> the token-id sequences the sampler bans (vLLM's rule), in the front.

Each word is tokenized without special tokens twice: as written with leading whitespace
stripped, then with one leading space. The spaced form is kept too only when its first token
differs from the plain form's and it has as many tokens (so it is the same word in the middle
of text, not a split of it). The core and the worker only ever see the id sequences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.tokenizer_type import Tokenizer
from tokenwire.runtime.sampling_params import SamplingParams


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The sequences of ``words``, in order (plain form, then the spaced one if kept)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        stripped = word.lstrip()
        plain, spaced = (
            tuple(ids)
            for ids in tokenizer([stripped, " " + stripped], add_special_tokens=False)["input_ids"]
        )
        if not plain:
            raise ParameterError("bad_words", f"{word!r} tokenizes to no tokens")
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def resolve_bad_words(tokenizer: Tokenizer | None, params: SamplingParams) -> SamplingParams:
    """``params`` with its bad words tokenized (unchanged when it has none or has ids)."""
    if not params.bad_words or params.bad_words_token_ids:
        return params
    if tokenizer is None:
        raise ParameterError("bad_words", "this model has no tokenizer to tokenize them")
    return dataclasses.replace(
        params, bad_words_token_ids=bad_words_token_ids(tokenizer, params.bad_words)
    )
