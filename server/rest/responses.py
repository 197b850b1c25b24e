"""``tokenwire.v1`` answers -> OpenAI response bodies (plain JSON-ready dicts).

Finish reasons: EOS, STOP_TOKEN and STOP_SEQUENCE -> "stop"; LENGTH, CONTEXT_LENGTH and
TIME_LIMIT -> "length"; CANCELLED -> "abort" and ERROR -> "error" (vLLM's values for the
cases OpenAI has no name for). Each choice also carries vLLM's ``stop_reason``: the stop
string or stop token id that ended it, else null. Logprobs of -inf are reported as -9999.0
(as vLLM does) so every body is valid JSON.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenwire.v1 import common_pb2, generation_pb2

JSON = dict[str, Any]


@dataclass(frozen=True)
class Echo:
    """Completions' echo (``rest/echo``): each prompt's text and, with logprobs, its first
    token decoded on its own."""

    texts: tuple[str, ...]
    first_tokens: tuple[str, ...] | None
    top: int | None
    only: bool


@dataclass(frozen=True)
class OutputFlags:
    """vLLM's output options of one request: ``prompt_logprobs`` asked for, logprob tokens
    named ``token_id:<id>`` (``return_tokens_as_token_ids``), completions' echo."""

    prompt_logprobs: bool = False
    token_ids_names: bool = False
    echo: Echo | None = None


_FINISH: dict[int, str] = {
    common_pb2.FINISH_REASON_EOS: "stop",
    common_pb2.FINISH_REASON_STOP_TOKEN: "stop",
    common_pb2.FINISH_REASON_STOP_SEQUENCE: "stop",
    common_pb2.FINISH_REASON_GRAMMAR_END: "stop",  # as vLLM: a grammar that ended stops
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CONTEXT_LENGTH: "length",
    common_pb2.FINISH_REASON_TIME_LIMIT: "length",
    common_pb2.FINISH_REASON_CANCELLED: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


def finish_reason(reason: int) -> str | None:
    return _FINISH.get(reason)


def stop_reason(end: generation_pb2.ChoiceEnd | generation_pb2.Choice) -> str | int | None:
    if end.stop_sequence:
        return end.stop_sequence
    if end.HasField("stop_token_id"):
        return end.stop_token_id
    return None


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else -9999.0


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> JSON:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sum_usage(usages: Sequence[common_pb2.Usage]) -> JSON:
    return usage(
        sum(u.prompt_tokens for u in usages),
        sum(u.completion_tokens for u in usages),
        sum(u.cached_tokens for u in usages),
    )


# ---------------------------------------------------------------------------- logprobs
def token_name(lp: common_pb2.TokenLogprob, as_ids: bool = False) -> str:
    """The token's text; ``token_id:<id>`` when it decodes to nothing (no tokenizer, or a
    skipped special token) or ``as_ids`` (vLLM's ``return_tokens_as_token_ids``)."""
    return f"token_id:{lp.token_id}" if as_ids or not lp.token else lp.token


def _chat_token(lp: common_pb2.TokenLogprob, as_ids: bool) -> JSON:
    return {
        "token": token_name(lp, as_ids),
        "logprob": finite(lp.logprob),
        "bytes": list(lp.token.encode()),
    }


def chat_logprobs(
    positions: Sequence[common_pb2.PositionLogprobs], as_ids: bool = False
) -> list[JSON]:
    """OpenAI chat ``logprobs.content``: one entry per generated token."""
    return [
        {
            **_chat_token(p.chosen, as_ids),
            "top_logprobs": [_chat_token(t, as_ids) for t in p.top],
        }
        for p in positions
    ]


def prompt_logprobs_body(positions: Sequence[common_pb2.PositionLogprobs]) -> list[JSON | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per position a map
    from token id to ``{logprob, rank, decoded_token}`` (the prompt's token and the top)."""
    body: list[JSON | None] = [None]
    for p in positions:
        entry = {str(t.token_id): _prompt_token(t) for t in p.top}
        entry[str(p.chosen.token_id)] = _prompt_token(p.chosen)
        body.append(entry)
    return body


def _prompt_token(lp: common_pb2.TokenLogprob) -> JSON:
    return {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.token}


def completion_logprobs(
    positions: Sequence[common_pb2.PositionLogprobs], offset: int, as_ids: bool = False
) -> tuple[JSON, int]:
    """OpenAI completions ``logprobs`` for these positions; text offsets start at ``offset``.

    Returns the object and the offset after the last token. ``top_logprobs`` holds the top
    alternatives and the chosen token (as vLLM reports them).
    """
    tokens, token_logprobs, top, offsets = [], [], [], []
    for p in positions:
        tokens.append(token_name(p.chosen, as_ids))
        token_logprobs.append(finite(p.chosen.logprob))
        alternatives = {token_name(t, as_ids): finite(t.logprob) for t in p.top}
        alternatives.setdefault(token_name(p.chosen, as_ids), finite(p.chosen.logprob))
        top.append(alternatives)
        offsets.append(offset)
        offset += len(p.chosen.token)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
    return body, offset


def echo_logprobs(
    echo: Echo,
    index: int,
    prompt: Sequence[common_pb2.PositionLogprobs],
    generated: Sequence[common_pb2.PositionLogprobs],
    as_ids: bool,
) -> JSON:
    """Prompt ``index``'s choice logprobs: its prompt's tokens, then ``generated``'s."""
    assert echo.first_tokens is not None and echo.top is not None
    first = echo.first_tokens[index]
    tokens: list[str] = [first]
    token_logprobs: list[float | None] = [None]
    top: list[JSON | None] = [None]
    offsets, offset = [0], len(first)
    for p in prompt:
        tokens.append(token_name(p.chosen, as_ids))
        token_logprobs.append(finite(p.chosen.logprob))
        ranked = sorted(p.top, key=lambda t: t.rank)[: echo.top]
        alternatives = {token_name(t, as_ids): finite(t.logprob) for t in ranked}
        alternatives.setdefault(token_name(p.chosen, as_ids), finite(p.chosen.logprob))
        top.append(alternatives)
        offsets.append(offset)
        offset += len(p.chosen.token)
    after, _ = completion_logprobs([] if echo.only else generated, offset, as_ids)
    return {
        "tokens": tokens + after["tokens"],
        "token_logprobs": token_logprobs + after["token_logprobs"],
        "top_logprobs": top + after["top_logprobs"],
        "text_offset": offsets + after["text_offset"],
    }


# ---------------------------------------------------------------------------- tool calls
def tool_call(call: common_pb2.ToolCall) -> JSON:
    function = {"name": call.function.name, "arguments": call.function.arguments}
    return {"id": call.id, "type": "function", "function": function}


def tool_call_delta(piece: common_pb2.ToolCallDelta) -> JSON:
    """OpenAI's streamed call piece: id, type and name on the first piece of a call only."""
    if piece.id:
        function = {"name": piece.name, "arguments": piece.arguments}
        return {"index": piece.index, "id": piece.id, "type": "function", "function": function}
    return {"index": piece.index, "function": {"arguments": piece.arguments}}


def chat_finish_reason(reason: int, called: bool, named_tool: bool) -> str | None:
    """OpenAI's "tool_calls" when the model chose to call (not when a function was named)."""
    if called and not named_tool and finish_reason(reason) == "stop":
        return "tool_calls"
    return finish_reason(reason)


def chat_message(c: generation_pb2.Choice) -> JSON:
    message: JSON = {"role": "assistant", "content": c.text, "refusal": None}
    if c.tool_calls:
        message["tool_calls"] = [tool_call(t) for t in c.tool_calls]
        message["content"] = c.text or None
    if c.reasoning_content:
        message["reasoning_content"] = c.reasoning_content
    return message


# ---------------------------------------------------------------------------- unary bodies
def chat_response(
    response_id: str,
    created: int,
    response: generation_pb2.GenerateResponse,
    logprobs: bool,
    named_tool: bool = False,
    options: OutputFlags = OutputFlags(),
) -> JSON:
    choices = []
    for c in response.choices:
        choices.append(
            {
                "index": c.index,
                "message": chat_message(c),
                "logprobs": {
                    "content": chat_logprobs(c.logprobs, options.token_ids_names),
                    "refusal": None,
                }
                if logprobs
                else None,
                "finish_reason": chat_finish_reason(
                    c.finish_reason, bool(c.tool_calls), named_tool
                ),
                "stop_reason": stop_reason(c),
            }
        )
    body = {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": response.model,
        "choices": choices,
        "usage": sum_usage([response.usage]),
    }
    if options.prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs_body(response.prompt_logprobs)
    return body


def completion_response(
    response_id: str,
    created: int,
    responses: Sequence[generation_pb2.GenerateResponse],
    n: int,
    logprobs: bool,
    options: OutputFlags = OutputFlags(),
) -> JSON:
    """Prompt ``i``'s choice ``j`` becomes choice ``i * n + j``, as at OpenAI; with echo,
    each choice's text starts with its prompt's text."""
    choices = []
    echo = options.echo
    for i, response in enumerate(responses):
        for c in response.choices:
            choice: JSON = {
                "index": i * n + c.index,
                "text": c.text if echo is None else echo.texts[i] + ("" if echo.only else c.text),
                "logprobs": _choice_logprobs(response, c, i, logprobs, options),
                "finish_reason": "length" if echo and echo.only else finish_reason(c.finish_reason),
                "stop_reason": None if echo and echo.only else stop_reason(c),
            }
            if options.prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs_body(response.prompt_logprobs)
            choices.append(choice)
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": responses[0].model,
        "choices": choices,
        "usage": sum_usage([_shown_usage(r.usage, echo) for r in responses]),
    }


def _choice_logprobs(
    response: generation_pb2.GenerateResponse,
    choice: generation_pb2.Choice,
    index: int,
    logprobs: bool,
    options: OutputFlags,
) -> JSON | None:
    if not logprobs:
        return None
    as_ids = options.token_ids_names
    if options.echo is not None and options.echo.first_tokens is not None:
        return echo_logprobs(options.echo, index, response.prompt_logprobs, choice.logprobs, as_ids)
    return completion_logprobs(choice.logprobs, 0, as_ids)[0]


def _shown_usage(u: common_pb2.Usage, echo: Echo | None) -> common_pb2.Usage:
    """Echo without generation shows no completion tokens (one was made upstream)."""
    if echo is None or not echo.only:
        return u
    return common_pb2.Usage(prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens)
