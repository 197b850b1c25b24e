"""gRPC stream events -> OpenAI server-sent events.

Chat: per choice a ``delta.role`` chunk first (at the gRPC Start event), content chunks (one
per TokenDelta), one final chunk with an empty delta and ``finish_reason`` (at ChoiceEnd).
Completions: text chunks and a final chunk per choice; prompt ``i``'s choice ``j`` is index
``i * n + j``. With ``stream_options.include_usage`` every chunk carries ``"usage": null`` and
a last chunk with no choices carries the usage of all prompts; with vLLM's
``continuous_usage_stats`` too, every chunk carries the usage so far instead of null (the
prompt tokens of the prompts started and every token generated, all choices together, so
the last one equals the final usage). Chat chunks whose tokens produced no visible text (a
tool call's held-back JSON, a possible stop string) are not sent unless logprobs are asked
for; their tokens count in the next chunk's usage. Then ``data: [DONE]``. An
error after the stream started becomes an SSE error event (the OpenAI envelope), then
``[DONE]``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import grpc

from tokenwire.server.rest.errors import RestError, from_rpc_error
from tokenwire.server.rest.responses import (
    JSON,
    OutputFlags,
    chat_finish_reason,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    stop_reason,
    sum_usage,
    tool_call_delta,
)
from tokenwire.server.rest.responses import usage as usage_body
from tokenwire.server.rest.upstream import Event, OpenStreams
from tokenwire.v1 import common_pb2, generation_pb2

logger = logging.getLogger("tokenwire.rest")
DONE = b"data: [DONE]\n\n"


def sse(payload: JSON) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True)
class StreamSpec:
    response_id: str
    created: int
    n: int
    logprobs: bool
    include_usage: bool
    named_tool: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage so far per chunk
    flags: OutputFlags = field(default_factory=OutputFlags)  # token ids as names; echo


class _Chunks:
    """Chunk envelopes and usage bookkeeping shared by chat and completions."""

    object_name = ""

    def __init__(self, spec: StreamSpec) -> None:
        self.spec = spec
        self.model = ""
        self.usages: list[common_pb2.Usage] = []
        self.prompts: dict[int, generation_pb2.StreamStart] = {}  # started prompts
        self.generated = 0  # tokens generated so far, all choices

    def chunk(self, choices: list[JSON], usage: JSON | None = None) -> bytes:
        payload: JSON = {
            "id": self.spec.response_id,
            "object": self.object_name,
            "created": self.spec.created,
            "model": self.model,
            "choices": choices,
        }
        if self.spec.include_usage:
            payload["usage"] = usage if usage is not None or not choices else self.so_far()
        return sse(payload)

    def so_far(self) -> JSON | None:
        """With continuous usage: the usage of the response so far (else None)."""
        if not self.spec.continuous_usage:
            return None
        starts = self.prompts.values()
        return usage_body(
            sum(s.prompt_tokens for s in starts),
            self.generated,
            sum(s.cached_tokens for s in starts),
        )

    def on_event(self, prompt: int, event: Event) -> bytes:
        kind = event.WhichOneof("event")
        if kind == "start":
            self.model = event.start.model
            self.prompts[prompt] = event.start
            return self.on_start(prompt)
        if kind == "delta":
            self.generated += len(event.delta.token_ids)
            return self.on_delta(prompt, event.delta)
        if kind == "end":
            return self.on_end(prompt, event.end)
        if kind == "usage":
            self.usages.append(event.usage)
        return b""

    def finish(self) -> bytes:
        if not self.spec.include_usage:
            return b""
        return self.chunk([], sum_usage(self.usages))

    def end_choice(self, index: int, end: generation_pb2.ChoiceEnd) -> JSON:
        return {
            "index": index,
            "logprobs": None,
            "finish_reason": finish_reason(end.finish_reason),
            "stop_reason": stop_reason(end),
        }

    def on_start(self, prompt: int) -> bytes:
        return b""

    def on_delta(self, prompt: int, delta: generation_pb2.TokenDelta) -> bytes:
        raise NotImplementedError

    def on_end(self, prompt: int, end: generation_pb2.ChoiceEnd) -> bytes:
        raise NotImplementedError


class ChatChunks(_Chunks):
    """Deltas carry ``content``, or the parts a parser split out: ``reasoning_content`` and
    ``tool_calls`` pieces (OpenAI's streaming shape); a choice that called a tool (without
    a named tool_choice) ends with ``finish_reason: "tool_calls"``."""

    object_name = "chat.completion.chunk"

    def __init__(self, spec: StreamSpec) -> None:
        super().__init__(spec)
        self.called: set[int] = set()  # choices that streamed a tool call

    def on_start(self, prompt: int) -> bytes:
        return b"".join(
            self.chunk(
                [
                    {
                        "index": j,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for j in range(self.spec.n)
        )

    def on_delta(self, prompt: int, delta: generation_pb2.TokenDelta) -> bytes:
        if not (delta.text or delta.reasoning_text or delta.tool_calls or self.spec.logprobs):
            return b""  # tokens whose text is held back (a tool call's, a stop string's)
        names = self.spec.flags.token_ids_names
        logprobs = {"content": chat_logprobs(delta.logprobs, names), "refusal": None}
        body: JSON = {"content": delta.text}
        if delta.reasoning_text or delta.tool_calls:
            body = {"content": delta.text} if delta.text else {}
            if delta.reasoning_text:
                body["reasoning_content"] = delta.reasoning_text
            if delta.tool_calls:
                body["tool_calls"] = [tool_call_delta(p) for p in delta.tool_calls]
                self.called.add(delta.index)
        choice = {
            "index": delta.index,
            "delta": body,
            "logprobs": logprobs if self.spec.logprobs else None,
            "finish_reason": None,
        }
        return self.chunk([choice])

    def on_end(self, prompt: int, end: generation_pb2.ChoiceEnd) -> bytes:
        choice = {**self.end_choice(end.index, end), "delta": {}}
        called = end.index in self.called
        choice["finish_reason"] = chat_finish_reason(
            end.finish_reason, called, self.spec.named_tool
        )
        return self.chunk([choice])


class CompletionChunks(_Chunks):
    object_name = "text_completion"

    def __init__(self, spec: StreamSpec) -> None:
        super().__init__(spec)
        self.offsets: dict[int, int] = {}  # text offset per choice index, for logprobs

    def on_start(self, prompt: int) -> bytes:
        """With echo: one chunk per choice with the prompt's text, first."""
        echo = self.spec.flags.echo
        if not echo:
            return b""
        return b"".join(
            self.chunk(
                [
                    {
                        "index": prompt * self.spec.n + j,
                        "text": echo.texts[prompt],
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for j in range(self.spec.n)
        )

    def on_delta(self, prompt: int, delta: generation_pb2.TokenDelta) -> bytes:
        index = prompt * self.spec.n + delta.index
        logprobs = None
        if self.spec.logprobs:
            logprobs, self.offsets[index] = completion_logprobs(
                delta.logprobs, self.offsets.get(index, 0), self.spec.flags.token_ids_names
            )
        choice = {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": None}
        return self.chunk([choice])

    def on_end(self, prompt: int, end: generation_pb2.ChoiceEnd) -> bytes:
        return self.chunk([{**self.end_choice(prompt * self.spec.n + end.index, end), "text": ""}])


async def sse_events(
    streams: OpenStreams, chunks: _Chunks, params: Mapping[str, str]
) -> AsyncIterator[bytes]:
    """The SSE body. Cancellation (the client went away) cancels every gRPC call."""
    try:
        async for prompt, event in streams.events():
            piece = chunks.on_event(prompt, event)
            if piece:
                yield piece
        tail = chunks.finish()
        if tail:
            yield tail
    except grpc.aio.AioRpcError as err:
        yield from_rpc_error(err, params).sse_event()
    except Exception:
        logger.exception("stream failed (request id in the response header)")
        yield RestError(500, "internal error", "internal_error").sse_event()
    yield DONE
