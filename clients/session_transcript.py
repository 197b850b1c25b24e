"""What a client ``Session`` remembers of its conversation, so it can reopen it elsewhere.

The server keeps a session's transcript and KV cache on one replica. When that replica dies
or drains, the client reopens the session (the channel, or a gateway, routes the new stream
to a live replica) with ``SessionOpen.history``: the chat messages so far (each user turn and
the reply of its first choice), or the token ids of a raw session that sent token ids only.
The first turn there recomputes the transcript. A raw session that sent text cannot be
replayed exactly (its tokenization belongs to the server) and is not reopened.
"""

from __future__ import annotations

from tokenwire.v1 import common_pb2 as pb
from tokenwire.v1 import generation_pb2 as gen


class Transcript:
    def __init__(self) -> None:
        self.messages: list[pb.ChatMessage] = []
        self.token_ids: list[int] | None = []  # None: a raw text turn was sent
        self._turn: gen.SessionTurn | None = None
        self._reply_text: list[str] = []
        self._reply_ids: list[int] = []

    @property
    def replayable(self) -> bool:
        return self.token_ids is not None or bool(self.messages)

    def start(self, turn: gen.SessionTurn) -> None:
        """A turn is being sent: its reply is collected until ``commit``."""
        self._turn = turn
        self._reply_text, self._reply_ids = [], []

    def reply(self, index: int, text: str, token_ids: list[int]) -> None:
        if index == 0:
            self._reply_text.append(text)
            self._reply_ids.extend(token_ids)

    def commit(self) -> None:
        """The turn ended (finished or cancelled): it is part of the transcript now."""
        turn, self._turn = self._turn, None
        if turn is None:
            return
        kind = turn.WhichOneof("input")
        if kind == "user_message":
            self.messages.append(pb.ChatMessage(role="user", content=turn.user_message))
        elif kind == "user_content":  # its images too: the reopened session holds them
            self.messages.append(pb.ChatMessage(role="user", parts=turn.user_content.parts))
        if kind in ("user_message", "user_content"):
            self.messages.append(
                pb.ChatMessage(role="assistant", content="".join(self._reply_text))
            )
        elif kind == "token_ids" and self.token_ids is not None:
            self.token_ids.extend([*turn.token_ids.ids, *self._reply_ids])
        else:
            self.token_ids = None

    def opening(self, base: gen.SessionRequest) -> gen.SessionRequest:
        """``base`` (the original Open) carrying the transcript so far."""
        request = gen.SessionRequest()
        request.CopyFrom(base)
        if self.messages:
            request.open.history.extend(self.messages)
        elif self.token_ids:
            request.open.history_token_ids.ids.extend(self.token_ids)
        return request
