"""Outputs: per-step engine-core deltas and the user-facing offline result types."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenwire.runtime.model_output import TokenLogprobs


class FinishReason(enum.StrEnum):
    """Why a choice ended. Finer than OpenAI's: the REST shim (``server/rest/responses.py``)
    maps these to OpenAI's ``finish_reason`` values."""

    LENGTH = "length"  # max_tokens reached
    CONTEXT_LENGTH = "context_length"  # prompt + output reached max_model_len
    EOS = "eos"
    # The structured-output grammar completed with no stop token to sample (``ignore_eos``
    # and no ``stop_token_ids``): the last token is content. OpenAI/vLLM: "stop".
    GRAMMAR_END = "grammar_end"
    STOP_TOKEN = "stop_token"  # one of stop_token_ids
    STOP_SEQUENCE = "stop_sequence"  # one of the stop strings
    TIME_LIMIT = "time_limit"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(slots=True)
class EngineCoreOutput:
    """What happened to one request in one step (token ids only; text is made in the front)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Set when the request failed on a bad parameter found in the core (a constraint that
    # did not compile): the parameter's name; ``stop_reason`` holds the message.
    error_param: str | None = None
    # An embedding request's pooled vector (it finishes in the step its prompt completes).
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM-shaped logprob entry: ``rank`` is 1-based in the model's distribution."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> Logprob, the chosen token first, then the top alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended the choice, if any.
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    # Embedding requests: the pooled vector (``outputs`` holds one empty choice).
    embedding: list[float] | None = None


@dataclass(slots=True)
class ChoiceDelta:
    """New output of one choice in one step. Concatenated ``text`` deltas equal the final text."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True, slots=True)
class RequestStarted:
    """A request produced its first output: it was admitted and its prefill ran."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(frozen=True, slots=True)
class EmbeddingRequestOutput:
    """``LLM.embed``'s result per input (vLLM's shape: ``.outputs.embedding``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass(frozen=True, slots=True)
class ScoringOutput:
    score: float


@dataclass(frozen=True, slots=True)
class ScoringRequestOutput:
    """``LLM.score``'s result per text pair (vLLM's shape: ``.outputs.score``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
