"""A GenerateStream -> the Responses API's server-sent events, in OpenAI's order.

``response.created``, ``response.in_progress``; per output item ``response.output_item.added``,
then for a message ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done`` (a reasoning item the same with
``reasoning_text``), for a function call ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``; each item ends with ``response.output_item.done``;
last ``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``,
``response.failed`` on an engine error) carrying the whole response. Every event has a
``sequence_number`` counting from 0. Events are ``event: <type>`` + ``data: <json>``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenwire.server.rest.responses_api.output import (
    JSON,
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    status_of,
    usage_body,
)
from tokenwire.v1 import common_pb2, generation_pb2

# status, output items, usage -> the response object
ResponseBuilder = Callable[[str, list[JSON], JSON | None], JSON]
_FINAL_EVENT = {"incomplete": "response.incomplete", "failed": "response.failed"}


def sse_event(payload: JSON) -> bytes:
    data = json.dumps(payload, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n".encode()


@dataclass
class _Open:
    kind: str  # "message" | "reasoning" | "function_call"
    index: int  # output_index
    text: str = ""


@dataclass
class ResponseEvents:
    build: ResponseBuilder
    items: list[JSON] = field(default_factory=list)
    status: str = "in_progress"
    usage: JSON | None = None
    _seq: int = 0
    _text: _Open | None = None  # the open message or reasoning item
    _calls: dict[int, _Open] = field(default_factory=dict)  # tool-call index -> its item

    def _emit(self, kind: str, **fields: object) -> bytes:
        payload: JSON = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(payload)

    def start(self) -> bytes:
        response = self.build("in_progress", [], None)
        return self._emit("response.created", response=response) + self._emit(
            "response.in_progress", response=response
        )

    def on_delta(self, delta: generation_pb2.TokenDelta) -> bytes:
        out = b""
        if delta.reasoning_text:
            out += self._text_delta("reasoning", delta.reasoning_text)
        if delta.text:
            out += self._text_delta("message", delta.text)
        for piece in delta.tool_calls:
            out += self._call_piece(piece)
        return out

    def _text_delta(self, kind: str, text: str) -> bytes:
        out = b""
        if self._text is not None and self._text.kind != kind:
            out += self._close_text("completed")
        if self._text is None:
            out += self._open_text(kind)
        current = self._text
        assert current is not None
        current.text += text
        item_id = self.items[current.index]["id"]
        event = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra: JSON = {"logprobs": []} if kind == "message" else {}
        return out + self._emit(
            event,
            item_id=item_id,
            output_index=current.index,
            content_index=0,
            delta=text,
            **extra,
        )

    def _open_text(self, kind: str) -> bytes:
        make = message_item if kind == "message" else reasoning_item
        prefix = "msg" if kind == "message" else "rs"
        item = make(new_id(prefix), "", "in_progress")
        self.items.append(item)
        self._text = _Open(kind, len(self.items) - 1)
        part = _part(kind, "")
        return self._emit(
            "response.output_item.added", output_index=self._text.index, item=item
        ) + self._emit(
            "response.content_part.added",
            item_id=item["id"],
            output_index=self._text.index,
            content_index=0,
            part=part,
        )

    def _close_text(self, status: str) -> bytes:
        current, self._text = self._text, None
        assert current is not None
        item_id = self.items[current.index]["id"]
        make = message_item if current.kind == "message" else reasoning_item
        item = make(item_id, current.text, status)
        self.items[current.index] = item
        where = {"item_id": item_id, "output_index": current.index, "content_index": 0}
        if current.kind == "message":
            done = self._emit("response.output_text.done", text=current.text, logprobs=[], **where)
        else:
            done = self._emit("response.reasoning_text.done", text=current.text, **where)
        return (
            done
            + self._emit(
                "response.content_part.done", part=_part(current.kind, current.text), **where
            )
            + self._emit("response.output_item.done", output_index=current.index, item=item)
        )

    def _call_piece(self, piece: common_pb2.ToolCallDelta) -> bytes:
        out = b""
        call = self._calls.get(piece.index)
        if call is None:
            if self._text is not None:
                out += self._close_text("completed")
            item = function_call_item(new_id("fc"), piece.id, piece.name, "", "in_progress")
            self.items.append(item)
            call = self._calls[piece.index] = _Open("function_call", len(self.items) - 1)
            out += self._emit("response.output_item.added", output_index=call.index, item=item)
        if piece.arguments:
            call.text += piece.arguments
            out += self._emit(
                "response.function_call_arguments.delta",
                item_id=self.items[call.index]["id"],
                output_index=call.index,
                delta=piece.arguments,
            )
        return out

    def on_end(self, end: generation_pb2.ChoiceEnd) -> bytes:
        self.status = status_of(end.finish_reason)
        item_status = "incomplete" if self.status == "incomplete" else "completed"
        out = b""
        if not self.items:  # no output at all: still one (empty) message
            out += self._open_text("message")
        if self._text is not None:
            out += self._close_text(item_status)
        for call in self._calls.values():
            old = self.items[call.index]
            item = function_call_item(
                old["id"], old["call_id"], old["name"], call.text, item_status
            )
            self.items[call.index] = item
            out += self._emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=call.index,
                name=item["name"],
                arguments=call.text,
            ) + self._emit("response.output_item.done", output_index=call.index, item=item)
        self._calls = {}
        return out

    def finish(self, usage: common_pb2.Usage) -> bytes:
        self.usage = usage_body(usage)
        response = self.build(self.status, self.items, self.usage)
        kind = _FINAL_EVENT.get(self.status, "response.completed")
        return self._emit(kind, response=response)

    def error(self, body: JSON) -> bytes:
        """An error after the stream started (OpenAI's ``error`` event; the SDK raises it)."""
        self.status = "failed"
        error = body["error"]
        return self._emit(
            "error",
            code=error.get("code"),
            message=error.get("message"),
            param=error.get("param"),
            error=error,
        )


def _part(kind: str, text: str) -> JSON:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}
