"""Text pairs for a cross-encoder (``--task score``): vLLM's ``text_1`` / ``text_2`` pairing
rules, the pair's tokenization and the request's params.

Pairing: one ``text_1`` against every ``text_2`` (a string or a one-item list is broadcast),
else two lists of equal length, paired by index. A pair is tokenized as the tokenizer's text
pair (``[CLS] a [SEP] b [SEP]`` for BERT); the first position whose token type is 1 becomes
``PoolingParams.pair_start`` so the encoder gives the second text its token type.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.tokenizer_type import Tokenizer
from tokenwire.runtime.pooling_params import PoolingParams
from tokenwire.runtime.sampling_params import SamplingParams

# Pairs one score / rerank call may carry (rerank: documents; score: the pairs formed).
MAX_SCORE_PAIRS = 1024

TextOrTexts = str | Sequence[str]


def _as_list(param: str, value: TextOrTexts) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise ParameterError(param, "must hold at least one text")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ParameterError(param, f"item {i} must be a string")
    return texts


def pair_texts(text_1: TextOrTexts, text_2: TextOrTexts) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs to score; ParameterError naming ``text_1`` / ``text_2``."""
    left, right = _as_list("text_1", text_1), _as_list("text_2", text_2)
    if len(left) == 1:
        left = left * len(right)
    elif len(left) != len(right):
        raise ParameterError(
            "text_2",
            f"must hold one text or as many as text_1 ({len(left)}), got {len(right)}",
        )
    if len(left) > MAX_SCORE_PAIRS:
        raise ParameterError("text_2", f"at most {MAX_SCORE_PAIRS} pairs per call, got {len(left)}")
    return list(zip(left, right, strict=True))


def encode_pair(tokenizer: Tokenizer, first: str, second: str) -> tuple[list[int], int]:
    """The pair's token ids (special tokens added) and where the second text's part
    (token type 1) starts (a tokenizer without token types: the end, all type 0)."""
    encoded = tokenizer(first, second)
    ids = [int(t) for t in encoded["input_ids"]]
    types = encoded.get("token_type_ids")
    if types and 1 in types:
        return ids, list(types).index(1)
    return ids, max(1, len(ids))  # no segments: every token keeps type 0


def score_params(pair_start: int) -> SamplingParams:
    """A score request's params: prefill only, its pooled output is the pair's score."""
    return SamplingParams(
        max_tokens=None, temperature=0.0, pooling=PoolingParams(pair_start=pair_start)
    )
