"""The one place where ``tokenwire.v1`` protos and runtime types meet.

Unset optional fields take the model's default sampling parameters (``--generation-config``,
``EngineInfo.default_sampling``: temperature, top_p, top_k, min_p, repetition_penalty,
max_tokens) where it has them, else vLLM's defaults, except ``max_tokens``: unset means "until
EOS or the context length", as in OpenAI's chat API and vLLM's OpenAI server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenwire.runtime.errors import ParameterError, clip
from tokenwire.runtime.front.chat_images import ImageInput, has_images
from tokenwire.runtime.outputs import (
    ChoiceDelta,
    CompletionOutput,
    FinishReason,
    PositionLogprobs,
    RequestOutput,
)
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.server.grpc.images import ImageLimits
from tokenwire.server.grpc.request_options import template_kwargs
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool, default_max_prompt_bytes
from tokenwire.server.grpc.tools import ChatTooling, chat_messages, structured_output
from tokenwire.server.tool_parsers.chat import render_messages
from tokenwire.server.tool_parsers.tool_choice import FunctionSpec
from tokenwire.v1 import common_pb2, generation_pb2

_FINISH = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CONTEXT_LENGTH: common_pb2.FINISH_REASON_CONTEXT_LENGTH,
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
    FinishReason.STOP_TOKEN: common_pb2.FINISH_REASON_STOP_TOKEN,
    FinishReason.STOP_SEQUENCE: common_pb2.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.TIME_LIMIT: common_pb2.FINISH_REASON_TIME_LIMIT,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
    FinishReason.GRAMMAR_END: common_pb2.FINISH_REASON_GRAMMAR_END,
}


@dataclass(frozen=True)
class Limits:
    """Request limits enforced by the server (flags)."""

    max_n: int = 16
    max_stop_sequences: int = 16
    max_stop_sequence_chars: int = 256
    # UTF-8 bytes of prompt text accepted before tokenizing; None: 32 per context token.
    max_prompt_bytes: int | None = None
    # The largest response message (the gRPC send limit; the server sets it): a larger one
    # fails RESOURCE_EXHAUSTED RESPONSE_TOO_LARGE (server/grpc/send_limit.py). None: no check.
    max_response_bytes: int | None = None
    # Image parts (a vision-language model): --max-images-per-request, --max-image-bytes,
    # --max-image-pixels.
    images: ImageLimits = field(default_factory=ImageLimits)

    def __post_init__(self) -> None:
        if self.max_prompt_bytes is not None and self.max_prompt_bytes <= 0:
            raise ValueError("--max-prompt-bytes must be > 0")

    def prompt_bytes(self, max_model_len: int) -> int:
        """The prompt-text limit in force for a model with this context length."""
        if self.max_prompt_bytes is not None:
            return self.max_prompt_bytes
        return default_max_prompt_bytes(max_model_len)


def _opt(message: Any, name: str, default: Any) -> Any:
    return getattr(message, name) if message.HasField(name) else default


def sampling_params(
    sampling: common_pb2.SamplingOptions,
    stopping: common_pb2.StoppingOptions,
    output: common_pb2.OutputOptions,
    limits: Limits,
    defaults: Mapping[str, float | int] | None = None,
    constrained: bool = False,
) -> SamplingParams:
    """Build and validate runtime params; errors name the proto field. ``defaults``: the
    model's default sampling parameters, for the fields the request leaves unset. A
    constrained request (``structured_output``, or ``constrained``: a tool choice's grammar)
    gets no default repetition_penalty: it would push an extraction off the prompt's words."""
    structured = (
        structured_output(output.structured_output)
        if output.HasField("structured_output")
        else None
    )
    model = dict(defaults or {})
    if constrained or structured is not None:
        model.pop("repetition_penalty", None)
    n = _opt(sampling, "n", 1)
    if n > limits.max_n:
        raise ParameterError("n", f"must be <= {limits.max_n} (server limit), got {n}")
    stops = list(stopping.stop)
    if len(stops) > limits.max_stop_sequences:
        raise ParameterError("stop", f"at most {limits.max_stop_sequences} stop sequences")
    if any(len(s) > limits.max_stop_sequence_chars for s in stops):
        raise ParameterError(
            "stop", f"a stop sequence is longer than {limits.max_stop_sequence_chars} characters"
        )
    return SamplingParams(
        n=n,
        temperature=_opt(sampling, "temperature", model.get("temperature", 1.0)),
        top_p=_opt(sampling, "top_p", model.get("top_p", 1.0)),
        top_k=_opt(sampling, "top_k", model.get("top_k", 0)),
        min_p=_opt(sampling, "min_p", model.get("min_p", 0.0)),
        seed=_opt(sampling, "seed", None),
        presence_penalty=_opt(sampling, "presence_penalty", 0.0),
        frequency_penalty=_opt(sampling, "frequency_penalty", 0.0),
        repetition_penalty=_opt(
            sampling, "repetition_penalty", model.get("repetition_penalty", 1.0)
        ),
        logit_bias=dict(sampling.logit_bias) or None,
        allowed_token_ids=tuple(sampling.allowed_token_ids) or None,
        bad_words=tuple(sampling.bad_words),
        max_tokens=_opt(stopping, "max_tokens", model.get("max_tokens")),
        min_tokens=_opt(stopping, "min_tokens", 0),
        stop=tuple(stops),
        stop_token_ids=tuple(stopping.stop_token_ids),
        ignore_eos=_opt(stopping, "ignore_eos", False),
        include_stop_str_in_output=_opt(stopping, "include_stop_str_in_output", False),
        logprobs=_opt(output, "logprobs", None),
        prompt_logprobs=_opt(output, "prompt_logprobs", None),
        skip_special_tokens=_opt(output, "skip_special_tokens", True),
        structured_outputs=structured,
    )


def truncate_ids(ids: list[int], k: int, max_len: int, param: str) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``k`` tokens, -1 meaning the
    model's context length ``max_len``; another ``k`` below 1 is refused naming ``param``."""
    if k == -1:
        k = max_len
    if k < 1:
        raise ParameterError(param, f"must be >= 1 or -1, got {k}")
    return ids[-k:]


def truncate_prompt(
    request: generation_pb2.GenerateRequest, ids: list[int], max_len: int
) -> list[int]:
    """The request's ``truncate_prompt_tokens`` applied to its tokenized prompt (unset: all)."""
    if not request.HasField("truncate_prompt_tokens"):
        return ids
    return truncate_ids(ids, request.truncate_prompt_tokens, max_len, "truncate_prompt_tokens")


def merge_options(base: Any, override: Any) -> Any:
    """Field-by-field override of an options message (a Session's defaults by a Turn's)."""
    merged = type(base)()
    merged.CopyFrom(base)
    merged.MergeFrom(override)
    return merged


async def tokenize_input(
    pool: TokenizerPool | None,
    request: Any,
    tooling: ChatTooling | None = None,
    cache_salt: str | None = None,
) -> tuple[str | None, list[int], tuple[ImageInput, ...]]:
    """The ``input`` oneof of a GenerateRequest -> (prompt text or None, token ids, the
    prompt's images); a chat is rendered with ``tooling``'s tools, its images processed (or
    found processed) for the request's effective ``cache_salt``.

    Size checks come first; the tokenizer and image decoding run on ``pool``, never on the
    event loop."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise ParameterError("input", "one of text, token_ids or chat is required")
    if kind == "token_ids":
        return None, list(request.token_ids.ids), ()
    if pool is None:
        raise ParameterError(kind, "this model has no tokenizer: send token_ids")
    if kind == "text":
        if not request.text:
            raise ParameterError("text", "must not be empty")
        return request.text, await pool.encode("text", request.text), ()
    messages = chat_messages(request.chat)
    tools = tooling.tools if tooling is not None else []
    kwargs = template_kwargs(request.chat)
    if has_images(messages):
        shown, tool_objects = _prepare(pool, messages, tools)
        ids, images = await pool.render_chat_images("chat", shown, tool_objects, kwargs, cache_salt)
        return None, ids, images
    return None, await render_chat(pool, messages, tools, kwargs), ()


def _prepare(
    pool: TokenizerPool, messages: list[dict[str, Any]], tools: list[FunctionSpec] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages as the template gets them (tool calls and results converted) and the
    tool objects it gets."""
    if not messages:
        raise ParameterError("chat", "needs at least one message")
    for m in messages:
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise ParameterError(
                "chat", f"role must be system, user, assistant or tool: {clip(m['role'])!r}"
            )
    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return render_messages(messages, tools or [], pool.tokenizer.chat_template)
    return messages, None


async def render_chat(
    pool: TokenizerPool,
    messages: list[dict[str, Any]],
    tools: list[FunctionSpec] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """A text-only chat's token ids (Tokenize, sessions: image parts are refused)."""
    if has_images(messages):
        raise ParameterError("chat", "image parts are accepted by Generate and GenerateStream only")
    shown, tool_objects = _prepare(pool, messages, tools)
    return await pool.render_chat("chat", shown, tool_objects, kwargs)


# ---------------------------------------------------------------------------- outputs
def finish_reason(reason: FinishReason | None) -> common_pb2.FinishReason:
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else _FINISH[reason]


def logprobs_proto(
    positions: list[PositionLogprobs] | None, num_top: int | None
) -> list[common_pb2.PositionLogprobs]:
    """Chosen token first in each dict; ``top`` is the top-``num_top`` by rank."""
    if not positions or num_top is None:
        return []
    out = []
    for position in positions:
        items = list(position.items())
        chosen_id, chosen = items[0]
        top = sorted(
            (i for i in items if i[1].rank is not None and i[1].rank <= num_top),
            key=lambda i: i[1].rank or 0,
        )
        out.append(
            common_pb2.PositionLogprobs(
                chosen=_token_logprob(chosen_id, chosen),
                top=[_token_logprob(t, lp) for t, lp in top],
            )
        )
    return out


def prompt_logprobs_proto(
    positions: list[PositionLogprobs | None] | None, num_top: int | None
) -> list[common_pb2.PositionLogprobs]:
    """The prompt's logprobs after its first token (which has none), prompt token first."""
    if not positions or num_top is None:
        return []
    return logprobs_proto([p for p in positions[1:] if p is not None], num_top)


def _token_logprob(token_id: int, lp: Any) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=token_id, token=lp.decoded_token or "", logprob=lp.logprob, rank=lp.rank or 0
    )


def stop_fields(stop_reason: int | str | None) -> dict[str, Any]:
    if isinstance(stop_reason, str):
        return {"stop_sequence": stop_reason}
    if isinstance(stop_reason, int):
        return {"stop_token_id": stop_reason}
    return {}


def token_delta(delta: ChoiceDelta, num_top: int | None) -> generation_pb2.TokenDelta:
    return generation_pb2.TokenDelta(
        index=delta.index,
        text=delta.text,
        token_ids=delta.token_ids,
        logprobs=logprobs_proto(delta.logprobs, num_top),
    )


def choice_proto(c: CompletionOutput, num_top: int | None) -> generation_pb2.Choice:
    return generation_pb2.Choice(
        index=c.index,
        text=c.text,
        token_ids=c.token_ids,
        logprobs=logprobs_proto(c.logprobs, num_top),
        finish_reason=finish_reason(c.finish_reason),
        **stop_fields(c.stop_reason),
    )


def usage(output: RequestOutput) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=sum(len(c.token_ids) for c in output.outputs),
        cached_tokens=output.num_cached_tokens,
    )
