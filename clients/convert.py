"""Request building and response parsing shared by the sync and async clients.

Unset options stay unset in the proto (``HasField`` is false), so the server's defaults apply.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict

from tokenwire.clients import results as r
from tokenwire.clients.content import Content, Messages, chat_input, message_proto
from tokenwire.v1 import common_pb2 as pb
from tokenwire.v1 import generation_pb2 as gen


class GenerationOptions(TypedDict, total=False):
    """Sampling, stopping and output knobs; each one left out keeps the server default."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Mapping[int, float]
    max_tokens: int
    min_tokens: int
    stop: str | Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    logprobs: int
    skip_special_tokens: bool


_SAMPLING = (
    *("n", "temperature", "top_p", "top_k", "min_p", "seed"),
    *("presence_penalty", "frequency_penalty", "repetition_penalty"),
)
_STOPPING = ("max_tokens", "min_tokens", "ignore_eos", "include_stop_str_in_output")
_OUTPUT = ("logprobs", "skip_special_tokens")
_KNOWN = frozenset(GenerationOptions.__annotations__)


def call_metadata(
    api_key: str | None,
    request_id: str | None = None,
    priority: int | None = None,
    session_key: str | None = None,
) -> tuple[tuple[str, str], ...]:
    """gRPC metadata of one call: API key, request id, priority and the conversation's
    affinity key (``x-session-id``, what a gateway's consistent hashing reads) when given."""
    pairs: list[tuple[str, str]] = []
    if session_key:
        pairs.append(("x-session-id", session_key))
    if api_key:
        pairs.append(("authorization", f"Bearer {api_key}"))
    if request_id:
        pairs.append(("x-request-id", request_id))
    if priority is not None:
        pairs.append(("x-priority", str(int(priority))))
    return tuple(pairs)


def check_options(options: Mapping[str, Any]) -> None:
    """Reject misspelled option names (mypy catches them too, but not at runtime)."""
    unknown = sorted(set(options) - _KNOWN)
    if unknown:
        raise TypeError(f"unknown generation option(s): {', '.join(unknown)}")


def _set(options: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    return {name: options[name] for name in names if options.get(name) is not None}


def sampling_options(options: Mapping[str, Any]) -> pb.SamplingOptions:
    message = pb.SamplingOptions(**_set(options, _SAMPLING))
    for token_id, bias in (options.get("logit_bias") or {}).items():
        message.logit_bias[int(token_id)] = float(bias)
    return message


def stopping_options(options: Mapping[str, Any]) -> pb.StoppingOptions:
    message = pb.StoppingOptions(**_set(options, _STOPPING))
    stop = options.get("stop")
    if stop is not None:
        message.stop.extend([stop] if isinstance(stop, str) else list(stop))
    message.stop_token_ids.extend(options.get("stop_token_ids") or ())
    return message


def output_options(options: Mapping[str, Any]) -> pb.OutputOptions:
    return pb.OutputOptions(**_set(options, _OUTPUT))


def generate_request(
    prompt: str | Sequence[int] | None,
    messages: Messages | None,
    *,
    model: str = "",
    request_id: str | None = None,
    cache_salt: str | None = None,
    options: Mapping[str, Any],
) -> gen.GenerateRequest:
    """Build a ``GenerateRequest``; exactly one of ``prompt`` (text or ids) and ``messages``."""
    check_options(options)
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt (text or token ids) and messages")
    request = gen.GenerateRequest(
        model=model,
        request_id=request_id or "",
        cache_salt=cache_salt or "",
        sampling=sampling_options(options),
        stopping=stopping_options(options),
        output=output_options(options),
    )
    if messages is not None:
        request.chat.CopyFrom(chat_input(messages))
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt or ())
    return request


def session_open(
    model: str, system_prompt: str | None, cache_salt: str | None, options: Mapping[str, Any]
) -> gen.SessionRequest:
    check_options(options)
    opened = gen.SessionOpen(
        model=model,
        system_prompt=system_prompt or "",
        cache_salt=cache_salt or "",
        sampling=sampling_options(options),
        stopping=stopping_options(options),
        output=output_options(options),
    )
    return gen.SessionRequest(open=opened)


def session_turn(
    user_message: Content | None,
    text: str | None,
    token_ids: Sequence[int] | None,
    options: Mapping[str, Any],
) -> gen.SessionRequest:
    """Build a Turn; exactly one of ``user_message`` (chat: a string, or ordered parts with
    images), ``text`` and ``token_ids``."""
    check_options(options)
    if sum(x is not None for x in (user_message, text, token_ids)) != 1:
        raise ValueError("pass exactly one of user_message, text and token_ids")
    turn = gen.SessionTurn(
        sampling=sampling_options(options),
        stopping=stopping_options(options),
        output=output_options(options),
    )
    if isinstance(user_message, str):
        turn.user_message = user_message
    elif user_message is not None:
        parts = message_proto({"role": "user", "content": user_message}).parts
        if not parts:
            raise ValueError("user_message has no parts")
        turn.user_content.parts.extend(parts)
    elif text is not None:
        turn.text = text
    else:
        turn.token_ids.ids.extend(token_ids or ())
    return gen.SessionRequest(turn=turn)


# ----------------------------------------------------------------------------- responses


def finish_reason(value: int) -> str:
    """``FINISH_REASON_STOP_SEQUENCE`` -> ``"stop_sequence"``."""
    return str(pb.FinishReason.Name(value)).removeprefix("FINISH_REASON_").lower()


def _token_logprob(p: pb.TokenLogprob) -> r.TokenLogprob:
    return r.TokenLogprob(token_id=p.token_id, token=p.token, logprob=p.logprob, rank=p.rank)


def logprobs(positions: Iterable[pb.PositionLogprobs]) -> list[r.PositionLogprobs]:
    return [
        r.PositionLogprobs(
            token_id=p.chosen.token_id,
            token=p.chosen.token,
            logprob=p.chosen.logprob,
            rank=p.chosen.rank,
            top=[_token_logprob(t) for t in p.top],
        )
        for p in positions
    ]


def usage(u: pb.Usage) -> r.Usage:
    return r.Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def _stop_token_id(message: gen.Choice | gen.ChoiceEnd | gen.TurnEnd) -> int | None:
    return message.stop_token_id if message.HasField("stop_token_id") else None


def completion(response: gen.GenerateResponse) -> r.Completion:
    choices = [
        r.Choice(
            index=c.index,
            text=c.text,
            token_ids=list(c.token_ids),
            logprobs=logprobs(c.logprobs),
            finish_reason=finish_reason(c.finish_reason),
            stop_sequence=c.stop_sequence or None,
            stop_token_id=_stop_token_id(c),
        )
        for c in response.choices
    ]
    return r.Completion(response.request_id, response.model, choices, usage(response.usage))


def text_delta(d: gen.TokenDelta) -> r.TextDelta:
    return r.TextDelta(d.index, d.text, list(d.token_ids), logprobs(d.logprobs))


def stream_event(response: gen.GenerateStreamResponse) -> r.StreamEvent | None:
    """Convert one stream message; ``None`` for an event this client does not know."""
    kind = response.WhichOneof("event")
    if kind == "start":
        s = response.start
        return r.StreamStart(s.request_id, s.model, s.prompt_tokens, s.cached_tokens)
    if kind == "delta":
        return text_delta(response.delta)
    if kind == "end":
        e = response.end
        reason = finish_reason(e.finish_reason)
        stop_id = _stop_token_id(e)
        return r.ChoiceEnd(e.index, reason, e.stop_sequence or None, stop_id, e.completion_tokens)
    if kind == "usage":
        return r.StreamUsage(usage(response.usage))
    return None


def session_event(response: gen.SessionResponse) -> r.SessionEvent | r.SessionInfo | None:
    """Convert one session message (``TurnEnd.error`` is left to the caller)."""
    kind = response.WhichOneof("message")
    if kind == "opened":
        o = response.opened
        return r.SessionInfo(o.session_id, o.model, o.max_context_tokens)
    if kind == "turn_started":
        t = response.turn_started
        return r.TurnStart(t.turn, t.request_id, t.prompt_tokens, t.cached_tokens)
    if kind == "delta":
        return text_delta(response.delta.delta)
    if kind == "turn_end":
        e = response.turn_end
        reason = finish_reason(e.finish_reason)
        stop_id = _stop_token_id(e)
        stop = e.stop_sequence or None
        return r.TurnEnd(e.turn, e.index, reason, stop, stop_id, usage(e.usage))
    if kind == "notice":
        n = response.notice
        kind_name = str(gen.NoticeKind.Name(n.kind)).removeprefix("NOTICE_KIND_").lower()
        return r.Notice(kind_name, n.message)
    return None


def assemble(events: Iterable[r.StreamEvent]) -> r.Completion:
    """Fold stream events into the ``Completion`` the unary call would have returned."""
    request_id = model = ""
    parts: dict[int, list[r.TextDelta]] = {}
    ends: dict[int, r.ChoiceEnd] = {}
    total = r.Usage()
    for event in events:
        if isinstance(event, r.StreamStart):
            request_id, model = event.request_id, event.model
        elif isinstance(event, r.TextDelta):
            parts.setdefault(event.index, []).append(event)
        elif isinstance(event, r.ChoiceEnd):
            ends[event.index] = event
        else:
            total = event.usage
    choices = []
    for index in sorted(set(parts) | set(ends)):
        deltas = parts.get(index, [])
        end = ends.get(index)
        choices.append(
            r.Choice(
                index=index,
                text="".join(d.text for d in deltas),
                token_ids=[t for d in deltas for t in d.token_ids],
                logprobs=[p for d in deltas for p in d.logprobs],
                finish_reason=end.finish_reason if end else "unspecified",
                stop_sequence=end.stop_sequence if end else None,
                stop_token_id=end.stop_token_id if end else None,
            )
        )
    return r.Completion(request_id, model, choices, total)
