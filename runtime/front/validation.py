"""Token-level request checks against the model's immutable facts (vocabulary, context).

Both sides of the engine seam run them: the front before it admits a request (so a bad one
fails its call at once, before anything crosses to the core) and ``EngineCore.add_request``.
"""

from __future__ import annotations

from tokenwire.runtime.errors import ContextLengthError, ParameterError, WrongTaskError
from tokenwire.runtime.pooling_params import EmbedSpec, PoolingParams
from tokenwire.runtime.sampling_params import SamplingParams

# The range of a request's priority: a signed 64-bit integer, what the front <-> core wire
# (msgspec) carries.
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1


def validate_priority(priority: int) -> None:
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ParameterError("priority", "must be an integer in [-2**63, 2**63 - 1]")


def validate_rank(data_parallel_rank: int | None, data_parallel_size: int) -> None:
    """A request that names its engine core (``--data-parallel-size``) names one there is."""
    if data_parallel_rank is not None and not 0 <= data_parallel_rank < data_parallel_size:
        ranks = "one rank (0)" if data_parallel_size == 1 else f"ranks 0..{data_parallel_size - 1}"
        raise ParameterError(
            "data_parallel_rank", f"this worker has {ranks}, got {data_parallel_rank}"
        )


def validate_request(
    prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    if not prompt_token_ids:
        raise ParameterError("prompt", "must contain at least one token")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise ParameterError("prompt", f"token ids must lie in [0, {vocab_size}) (the vocabulary)")
    params.validate_for_model(vocab_size)
    num_prompt = len(prompt_token_ids)
    if params.pooling is not None:  # embeddings: the whole context, no output tokens
        if num_prompt > max_model_len:
            raise ContextLengthError(
                "input",
                f"{num_prompt} tokens exceed the model's context of {max_model_len} tokens",
            )
        return
    if num_prompt >= max_model_len:
        raise ContextLengthError(
            "prompt",
            f"{num_prompt} prompt tokens leave no room in the model's context of "
            f"{max_model_len} tokens",
        )
    if params.max_tokens is not None and num_prompt + params.max_tokens > max_model_len:
        raise ContextLengthError(
            "max_tokens",
            f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"model's context of {max_model_len} tokens",
        )


def check_task(model: str, embed: EmbedSpec | None, params: SamplingParams) -> None:
    """A generation request on an embedding model, or an embedding request on a
    generation model: ``WrongTaskError`` naming what the model serves."""
    if embed is None and params.pooling is not None:
        raise WrongTaskError(
            model, "generate", f"model {model!r} serves task 'generate': it computes no embeddings"
        )
    if embed is not None and embed.cross_encoder:
        check_score(model, embed, params.pooling or PoolingParams())
    if embed is not None and params.pooling is None:
        raise WrongTaskError(
            model,
            "embed",
            f"model {model!r} serves task 'embed': use EmbeddingService.Embed or "
            "/v1/embeddings, not generation",
        )
    if embed is not None and params.pooling is not None:
        check_score(model, embed, params.pooling)
        check_dimensions(embed, params.pooling)


def check_score(model: str, embed: EmbedSpec, pooling: PoolingParams) -> None:
    """A text-pair score request needs a cross-encoder, an embedding request a model that
    is not one: ``WrongTaskError`` naming what the model serves."""
    is_score = pooling.pair_start is not None
    if is_score and not embed.cross_encoder:
        raise WrongTaskError(
            model, "embed", f"model {model!r} serves task 'embed': it scores no text pairs"
        )
    if embed.cross_encoder and not is_score:
        raise WrongTaskError(
            model,
            "score",
            f"model {model!r} serves task 'score': use EmbeddingService.Score, /v1/score or "
            "/v1/rerank, not embeddings or generation",
        )


def check_dimensions(embed: EmbedSpec, pooling: PoolingParams) -> None:
    dims = pooling.dimensions
    if dims is None:
        return
    if not embed.is_matryoshka:
        raise ParameterError("dimensions", "this model does not support Matryoshka truncation")
    if dims > embed.hidden_size:
        raise ParameterError(
            "dimensions", f"must be <= the model's embedding size {embed.hidden_size}, got {dims}"
        )
    if embed.matryoshka_dimensions and dims not in embed.matryoshka_dimensions:
        sizes = ", ".join(str(d) for d in embed.matryoshka_dimensions)
        raise ParameterError("dimensions", f"must be one of the model's sizes {sizes}, got {dims}")
