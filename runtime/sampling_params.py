"""Sampling and stopping parameters of one request (vLLM-shaped).

Validation raises ``ValueError`` whose message starts with the parameter's name, so the
servers can map it to INVALID_ARGUMENT / 400 naming the field. Checks that need the model
(token ids inside the vocabulary, prompt + max_tokens within the context) happen in
``validate_for_model``, called by the engine when the request is added.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.pooling_params import PoolingParams
from tokenwire.runtime.structured.params import StructuredOutputsParams

# A temperature below this is treated as greedy (argmax), as in vLLM.
GREEDY_EPSILON = 1e-5
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
# At most this many bad words (and token-id sequences after tokenization) per request.
MAX_BAD_WORDS = 256

__all__ = [
    "MAX_LOGPROBS",
    "ParameterError",
    "PoolingParams",
    "SamplingParams",
    "StructuredOutputsParams",
    "embedding_params",
    "normalize_params",
]


def _check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ParameterError(name, f"must be a finite number, got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample and when to stop.

    ``max_tokens=None`` generates until EOS or the model's context length. ``top_k`` of 0 or -1
    disables top-k. ``stop`` accepts a string or a sequence of strings and is stored as a tuple.

    ``structured_outputs`` constrains the output to a JSON schema, any JSON object, a regex, a
    choice of strings or an EBNF grammar (vLLM's ``StructuredOutputsParams``): tokens the
    grammar does not allow are masked before sampling, EOS is allowed only where the grammar
    is complete, and the choice ends (EOS) when it is. Logprobs of a constrained request are
    those of the masked distribution (log-softmax over the allowed tokens only, as vLLM V1);
    ``min_tokens`` does not hold back EOS there (the grammar decides where output may end).

    ``pooling`` makes it an embedding request: the engine runs its prompt (chunked prefill
    as usual), pools the hidden states and finishes it without sampling.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    # vLLM: only these token ids may be sampled (a logits mask); None: any token.
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM: words never to generate. The front tokenizes them (``sample/bad_words.py``) into
    # ``bad_words_token_ids``, which is what the core and the worker use: a sequence's last
    # token is banned whenever the output so far ends with the rest (always, for one token).
    bad_words: tuple[str, ...] = field(default=())
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=())
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Set: an embedding request (prefill only, no sampling; ``pooling_params``).
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        # Normalise containers first so the object is hashable-ish and immutable.
        stop: Any = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        bad: Any = self.bad_words
        object.__setattr__(self, "bad_words", (bad,) if isinstance(bad, str) else tuple(bad or ()))
        object.__setattr__(
            self, "bad_words_token_ids", tuple(tuple(ids) for ids in self.bad_words_token_ids)
        )
        if self.logit_bias is not None:
            object.__setattr__(
                self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()}
            )
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ParameterError("n", f"must be an integer >= 1, got {self.n}")
        _check_finite("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ParameterError("temperature", f"must be >= 0, got {self.temperature}")
        _check_finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ParameterError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ParameterError("top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        _check_finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ParameterError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ParameterError("seed", f"must be in [0, 2**63 - 1], got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_finite(name, value)
            if not -2.0 <= value <= 2.0:
                raise ParameterError(name, f"must be in [-2, 2], got {value}")
        _check_finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ParameterError(
                "repetition_penalty", f"must be > 0, got {self.repetition_penalty}"
            )
        self._validate_lengths_and_stops()
        self._validate_logprobs_and_bias()
        self._validate_token_masks()

    def _validate_lengths_and_stops(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParameterError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ParameterError("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError(
                "min_tokens",
                f"must be <= max_tokens ({self.min_tokens} > {self.max_tokens})",
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ParameterError("stop", "every stop sequence must be a non-empty string")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ParameterError("stop_token_ids", f"must be non-negative integers, got {t}")

    def _validate_logprobs_and_bias(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ParameterError(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise ParameterError("logit_bias", f"token id must be >= 0, got {token}")
            if not -100.0 <= bias <= 100.0:
                raise ParameterError("logit_bias", f"bias must be in [-100, 100], got {bias}")

    def _validate_token_masks(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not allowed:
                raise ParameterError("allowed_token_ids", "must not be empty")
            for t in allowed:
                if not isinstance(t, int) or t < 0:
                    raise ParameterError(
                        "allowed_token_ids", f"must be non-negative integers, got {t}"
                    )
        if len(self.bad_words) > MAX_BAD_WORDS or len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
            raise ParameterError("bad_words", f"at most {MAX_BAD_WORDS} bad words")
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip():
                raise ParameterError("bad_words", "every bad word must be a non-blank string")
        for ids in self.bad_words_token_ids:
            if not ids or any(not isinstance(t, int) or t < 0 for t in ids):
                raise ParameterError(
                    "bad_words", f"token-id sequences must be non-empty and >= 0, got {list(ids)}"
                )

    @property
    def masks_tokens(self) -> bool:
        """Some token is masked by ``allowed_token_ids`` or ``bad_words``."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @cached_property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing else for the sampler to do (its fast path)."""
        return (
            self.greedy
            and not self.needs_penalties
            and not self.logit_bias
            and not self.masks_tokens
            and self.min_tokens == 0
            and self.logprobs is None
        )

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must lie inside the vocabulary."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ParameterError(
                    "stop_token_ids", f"token id {t} is outside the vocabulary ({vocab_size})"
                )
        for t in self.logit_bias or {}:
            if t >= vocab_size:
                raise ParameterError(
                    "logit_bias", f"token id {t} is outside the vocabulary ({vocab_size})"
                )
        for t in self.allowed_token_ids or ():
            if t >= vocab_size:
                raise ParameterError(
                    "allowed_token_ids", f"token id {t} is outside the vocabulary ({vocab_size})"
                )
        for ids in self.bad_words_token_ids:
            for t in ids:
                if t >= vocab_size:
                    raise ParameterError(
                        "bad_words", f"token id {t} is outside the vocabulary ({vocab_size})"
                    )

    def with_seed(self, seed: int | None) -> SamplingParams:
        """Copy with another seed (used to fan out ``n > 1`` into child requests)."""
        return replace(self, seed=seed, n=1)


def normalize_params(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt: broadcast a single one, or check the list length."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    out = list(params)
    if len(out) != count:
        raise ParameterError(
            "sampling_params", f"got {len(out)} sampling params for {count} prompts"
        )
    return out


def embedding_params(dimensions: int | None) -> SamplingParams:
    """The params of an embedding request: prefill only, no sampling, no output tokens;
    ``dimensions``: Matryoshka truncation (``PoolingParams``)."""
    return SamplingParams(max_tokens=None, temperature=0.0, pooling=PoolingParams(dimensions))
