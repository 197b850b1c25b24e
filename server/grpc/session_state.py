"""What one Session remembers between turns, and how a turn's prompt is built.

The KV blocks of the last turn stay referenced in the engine under ``holder_id``, so the next
turn's prompt (the whole transcript) gets a prefix hit on everything already computed and
prefills only its new tokens. The transcript itself is kept here as well, so a context the
engine evicted under memory pressure is simply recomputed on the next turn.

A session is either *chat* (turns are user messages, rendered with the chat template; the
assistant's reply is appended as a message) or *raw* (turns append text or token ids; the
reply's token ids are appended). The first turn decides; mixing is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.lora.request import LoRARequest
from tokenwire.server.grpc import convert
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool
from tokenwire.v1 import common_pb2, generation_pb2


@dataclass
class SessionState:
    session_id: str
    holder_id: str
    open: generation_pb2.SessionOpen
    lora: LoRARequest | None = None  # the adapter bound at Open (None: the base model)
    mode: str | None = None  # "chat" | "raw", fixed by the first turn
    messages: list[dict[str, str]] = field(default_factory=list)
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
        self, tokenizers: TokenizerPool | None, turn: generation_pb2.SessionTurn
    ) -> tuple[list[int], list[dict[str, str]] | None]:
        """Token ids of this turn's whole transcript, and the chat messages it renders."""
        kind = turn.WhichOneof("input")
        if kind is None:
            raise ParameterError("input", "a turn needs user_message, text or token_ids")
        mode = "chat" if kind == "user_message" else "raw"
        if self.mode is not None and mode != self.mode:
            raise ParameterError(kind, f"this session is a {self.mode} session")
        if kind == "user_message":
            if tokenizers is None:
                raise ParameterError("user_message", "this model has no tokenizer")
            messages = [*self.messages, {"role": "user", "content": turn.user_message}]
            if self.open.system_prompt and not self.messages:
                messages.insert(0, {"role": "system", "content": self.open.system_prompt})
            return await convert.render_chat(tokenizers, messages), messages
        if kind == "token_ids":
            return [*self.tokens, *turn.token_ids.ids], None
        if tokenizers is None:
            raise ParameterError("text", "this model has no tokenizer: send token_ids")
        special = not self.tokens  # special tokens (BOS) only at the start of the transcript
        new = await tokenizers.encode("text", turn.text, add_special_tokens=special)
        return [*self.tokens, *new], None

    def commit(
        self,
        prompt: list[int],
        messages: list[dict[str, str]] | None,
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
        messages = [{"role": m.role, "content": m.content} for m in opened.history]
        for m in messages:
            if m["role"] not in ("user", "assistant"):
                raise ParameterError("history", f"roles must be user or assistant: {m['role']!r}")
        if opened.system_prompt:
            messages.insert(0, {"role": "system", "content": opened.system_prompt})
        state.mode, state.messages = "chat", messages
    return state
