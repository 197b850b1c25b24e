"""OpenAI request models -> ``tokenwire.v1.GenerateRequest`` messages.

Besides the protos, each translation returns the map from proto field names to the OpenAI
names the client used, so a gRPC ``ErrorInfo.metadata["param"]`` comes back under the
client's name (``chat`` -> ``messages``, ``logprobs`` -> ``top_logprobs``, ``max_tokens`` ->
``max_completion_tokens`` when that is what was sent, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from tokenwire.server.rest.content_parts import has_images, message_parts
from tokenwire.server.rest.echo import EchoSpec
from tokenwire.server.rest.errors import invalid
from tokenwire.server.rest.models import (
    ChatCompletionRequest,
    ChatMessage,
    CommonFields,
    CompletionRequest,
    SamplingFields,
    StreamOptions,
)
from tokenwire.server.rest.structured import chat_tools, structured_output
from tokenwire.v1 import common_pb2, generation_pb2

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MAX_PROMPTS = 256  # prompts in one /v1/completions request (each is one gRPC request)

_HEADER_PARAMS = {"request_id": "x-request-id"}


@dataclass(frozen=True)
class Translated:
    """The gRPC request(s) of one OpenAI request and how to name its fields back."""

    requests: list[generation_pb2.GenerateRequest]
    params: Mapping[str, str]
    n: int
    logprobs: bool  # whether the client asked for logprobs
    include_usage: bool = False
    named_tool: bool = False  # tool_choice named a function: calls end with "stop"
    continuous_usage: bool = False  # usage so far on every chunk (vLLM)
    request_id: str | None = None  # vLLM's body field (the x-request-id header wins)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs were asked for
    token_ids_names: bool = False  # vLLM's return_tokens_as_token_ids
    echo: EchoSpec | None = None  # completions echo: the prompts (``rest/echo``)


def sampling_options(body: SamplingFields) -> common_pb2.SamplingOptions:
    """The sampling fields every generating endpoint shares (vLLM's extras included)."""
    return common_pb2.SamplingOptions(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
    )


def _sampling(body: CommonFields) -> common_pb2.SamplingOptions:
    options = sampling_options(body)
    if body.n is not None:
        options.n = body.n
    for key, bias in (body.logit_bias or {}).items():
        options.logit_bias[int(key)] = bias
    options.allowed_token_ids.extend(body.allowed_token_ids or ())
    options.bad_words.extend(body.bad_words or ())
    return options


def stopping_options(body: SamplingFields, max_tokens: int | None) -> common_pb2.StoppingOptions:
    """``max_tokens`` (under the endpoint's name) with the shared stop fields."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    return common_pb2.StoppingOptions(
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=stop,
        stop_token_ids=body.stop_token_ids or (),
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )


class _CallFields(TypedDict):
    include_usage: bool
    continuous_usage: bool
    request_id: str | None
    prompt_logprobs: bool
    token_ids_names: bool


def _call_fields(body: CommonFields) -> _CallFields:
    """``Translated``'s fields from ``stream_options``, vLLM's request id and output options.
    ``continuous_usage_stats`` needs ``include_usage``, which it implies when unset (vLLM)."""
    options = body.stream_options or StreamOptions()
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    if body.prompt_logprobs is not None and body.stream:
        raise invalid("prompt_logprobs", "prompt_logprobs are not available when stream is true")
    continuous = bool(options.continuous_usage_stats)
    include_usage = continuous if options.include_usage is None else options.include_usage
    return _CallFields(
        include_usage=include_usage,
        continuous_usage=include_usage and continuous,
        request_id=body.request_id,
        prompt_logprobs=body.prompt_logprobs is not None,
        token_ids_names=bool(body.return_tokens_as_token_ids),
    )


def _output(body: CommonFields, logprobs: int | None, structured: Any) -> common_pb2.OutputOptions:
    return common_pb2.OutputOptions(
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        structured_output=structured,
        prompt_logprobs=body.prompt_logprobs,
    )


def _chat_input(body: ChatCompletionRequest) -> tuple[common_pb2.ChatInput, dict[str, str]]:
    """The chat, and the proto -> OpenAI names of its image parts."""
    chat = common_pb2.ChatInput(reasoning_effort=body.reasoning_effort or "")
    names: dict[str, str] = {}
    for i, m in enumerate(body.messages):
        message = _chat_message(m)
        if isinstance(m.content, list) and has_images(m.content):
            parts, part_names = message_parts(m.content, i)
            message.content = ""
            message.parts.extend(parts)
            names.update(part_names)
        chat.messages.append(message)
    if body.chat_template_kwargs:
        chat.chat_template_kwargs_json = json.dumps(body.chat_template_kwargs)
    return chat, names


def chat_request(body: ChatCompletionRequest) -> Translated:
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise invalid("max_tokens", "set max_completion_tokens or max_tokens, not both")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs", "top_logprobs requires logprobs to be true")
    max_field = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
    max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    structured, structured_params = structured_output(body)
    chat, part_names = _chat_input(body)
    named = chat_tools(body, chat)
    request = generation_pb2.GenerateRequest(
        model=body.model,
        chat=chat,
        sampling=_sampling(body),
        stopping=stopping_options(body, max_tokens),
        output=_output(body, (body.top_logprobs or 0) if body.logprobs else None, structured),
        cache_salt=body.cache_salt or "",
        priority=body.priority,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )
    params = {
        **_HEADER_PARAMS,
        "chat_template_kwargs_json": "chat_template_kwargs",
        "chat": "messages",
        "input": "messages",
        "logprobs": "top_logprobs",
        "max_tokens": max_field,
        **structured_params,
        **part_names,
    }
    return Translated(
        [request],
        params,
        body.n or 1,
        bool(body.logprobs),
        named_tool=named,
        **_call_fields(body),
    )


def _chat_message(m: ChatMessage) -> common_pb2.ChatMessage:
    message = common_pb2.ChatMessage(
        role="system" if m.role == "developer" else m.role,
        content=m.text(),
        tool_call_id=m.tool_call_id or "",
    )
    for call in m.tool_calls or ():
        message.tool_calls.append(
            common_pb2.ToolCall(
                id=call.id,
                function=common_pb2.FunctionCall(
                    name=call.function.name, arguments=call.function.arguments
                ),
            )
        )
    return message


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def completion_requests(body: CompletionRequest) -> Translated:
    prompts = _prompts(body.prompt)
    if len(prompts) > MAX_PROMPTS:
        raise invalid("prompt", f"at most {MAX_PROMPTS} prompts per request")
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    echo = _echo(body, prompts, max_tokens)
    sampling = _sampling(body)
    stopping = stopping_options(body, 1 if echo is not None and echo.only else max_tokens)
    structured, structured_params = structured_output(body)
    output = _output(body, body.logprobs, structured)
    if echo is not None and echo.top is not None:  # the prompt's logprobs, k alternatives
        output.prompt_logprobs = max(echo.top, body.prompt_logprobs or 0)
    requests = []
    for prompt in prompts:
        request = generation_pb2.GenerateRequest(
            model=body.model,
            sampling=sampling,
            stopping=stopping,
            output=output,
            cache_salt=body.cache_salt or "",
            priority=body.priority,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
        )
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        requests.append(request)
    params = {
        **_HEADER_PARAMS,
        "text": "prompt",
        "token_ids": "prompt",
        "input": "prompt",
        **structured_params,
    }
    return Translated(
        requests, params, body.n or 1, body.logprobs is not None, echo=echo, **_call_fields(body)
    )


def _echo(
    body: CompletionRequest, prompts: list[str | list[int]], max_tokens: int
) -> EchoSpec | None:
    """What to echo (``rest/echo``): with ``logprobs`` the prompt's too, ``max_tokens: 0``
    the prompt alone; neither in a stream (400 naming ``echo``)."""
    if not body.echo:
        return None
    if body.truncate_prompt_tokens is not None:  # the echo would not be the prompt served
        raise invalid("truncate_prompt_tokens", "truncate_prompt_tokens cannot be used with echo")
    if body.stream and body.logprobs is not None:
        raise invalid("echo", "echo with logprobs is not available when stream is true")
    if body.stream and max_tokens == 0:
        raise invalid("echo", "echo with max_tokens 0 is not available when stream is true")
    return EchoSpec(tuple(prompts), body.logprobs, max_tokens == 0)
