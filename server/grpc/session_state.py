"""What one Session remembers between turns, and how a turn's prompt is built.

The KV blocks of the last turn stay referenced in the engine under ``holder_id``, so the next
turn's prompt (the whole transcript) gets a prefix hit on everything already computed and
prefills only its new tokens. The transcript itself is kept here as well, so a context the
engine evicted under memory pressure is simply recomputed on the next turn.

A session is either *chat* (turns are user messages, rendered with the chat template; the
assistant's reply is appended as a message) or *raw* (turns append text or token ids; the
reply's token ids are appended). The first turn decides; mixing is an error.

A chat turn may be ``user_content``: ordered text and image parts (a vision-language model).
The session keeps the images with their messages, so every later turn's prompt holds them
where they stood; the engine's image-aware prefix cache and encoder cache then reuse their
KV and encodings. The server's image limits (count, bytes, pixels) apply to each turn's whole
transcript, which also bounds what a session keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.chat_images import ImageInput, has_images
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.server.grpc import convert
from tokenwire.server.grpc.images import parts_content
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool
from tokenwire.v1 import common_pb2, generation_pb2


@dataclass
class SessionState:
    session_id: str
    holder_id: str
    open: generation_pb2.SessionOpen
    lora: LoRARequest | None = None  # the adapter bound at Open (None: the base model)
    mode: str | None = None  # "chat" | "raw", fixed by the first turn
    messages: list[dict[str, Any]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # raw mode: prompt + replies so far
    turns: int = 0  # turns received (numbering starts at 1)

    @property
    def model(self) -> str:
        """The adapter's name; empty for the base model."""
        return self.lora.lora_name if self.lora is not None else ""

    def options(
        self, turn: generation_pb2.SessionTurn
    ) -> tuple[common_pb2.SamplingOptions, common_pb2.StoppingOptions, common_pb2.OutputOptions]:
        return (
            convert.merge_options(self.open.sampling, turn.sampling),
            convert.merge_options(self.open.stopping, turn.stopping),
            convert.merge_options(self.open.output, turn.output),
        )

    async def prompt_for(
        self,
        tokenizers: TokenizerPool | None,
        turn: generation_pb2.SessionTurn,
        cache_salt: str | None = None,
    ) -> tuple[list[int], list[dict[str, Any]] | None, tuple[ImageInput, ...]]:
        """Token ids of this turn's whole transcript, the chat messages it renders and the
        transcript's images (in prompt order; processed or found processed for the turn's
        effective ``cache_salt``)."""
        kind = turn.WhichOneof("input")
        if kind is None:
            raise ParameterError(
                "input", "a turn needs user_message, user_content, text or token_ids"
            )
        mode = "chat" if kind in ("user_message", "user_content") else "raw"
        if self.mode is not None and mode != self.mode:
            raise ParameterError(kind, f"this session is a {self.mode} session")
        if kind == "token_ids":
            return [*self.tokens, *turn.token_ids.ids], None, ()
        if tokenizers is None:
            what = "send token_ids" if kind == "text" else "its sessions take token_ids"
            raise ParameterError(kind, f"this model has no tokenizer: {what}")
        if kind == "text":
            special = not self.tokens  # special tokens (BOS) only at the start of the transcript
            new = await tokenizers.encode("text", turn.text, add_special_tokens=special)
            return [*self.tokens, *new], None, ()
        messages = [*self.messages, {"role": "user", "content": _turn_content(turn)}]
        if self.open.system_prompt and not self.messages:
            messages.insert(0, {"role": "system", "content": self.open.system_prompt})
        if has_images(messages):
            ids, images = await tokenizers.render_chat_images(kind, messages, cache_salt=cache_salt)
            return ids, messages, images
        return await convert.render_chat(tokenizers, messages), messages, ()

    def commit(
        self,
        prompt: list[int],
        messages: list[dict[str, Any]] | None,
        reply_text: str,
        reply_tokens: list[int],
    ) -> None:
        """Record a finished (or cancelled) turn: its reply continues the transcript."""
        if messages is not None:
            self.mode = "chat"
            self.messages = [*messages, {"role": "assistant", "content": reply_text}]
        else:
            self.mode = "raw"
            self.tokens = [*prompt, *reply_tokens]


def resumed(state: SessionState) -> SessionState:
    """A session opened with a ``history`` (chat) or ``history_token_ids`` (raw) continues
    that transcript; its first turn prefills it. Roles other than user / assistant, or both
    kinds of history, are an INVALID_ARGUMENT naming the field."""
    opened = state.open
    raw = list(opened.history_token_ids.ids)
    if opened.history and raw:
        raise ParameterError("history", "give history or history_token_ids, not both")
    if raw:
        state.mode, state.tokens = "raw", raw
    elif opened.history:
        messages = [_history_message(m, i) for i, m in enumerate(opened.history)]
        if opened.system_prompt:
            messages.insert(0, {"role": "system", "content": opened.system_prompt})
        state.mode, state.messages = "chat", messages
    return state


def _history_message(m: common_pb2.ChatMessage, index: int) -> dict[str, Any]:
    """One message of ``SessionOpen.history``: a user or assistant message, its content
    text or (a user message) ordered text and image parts."""
    if m.role not in ("user", "assistant"):
        raise ParameterError("history", f"roles must be user or assistant: {m.role!r}")
    if not m.parts:
        return {"role": m.role, "content": m.content}
    where = f"history[{index}]"
    if m.content:
        raise ParameterError(where, "content and parts are exclusive: send one of them")
    return {"role": m.role, "content": parts_content(m.parts, m.role, where)}


def _turn_content(turn: generation_pb2.SessionTurn) -> str | list[dict[str, Any]]:
    """A chat turn's user message content: its text, or its parts."""
    if turn.WhichOneof("input") == "user_message":
        return turn.user_message
    if not turn.user_content.parts:
        raise ParameterError("user_content.parts", "must not be empty")
    return parts_content(turn.user_content.parts, "user", "user_content")
