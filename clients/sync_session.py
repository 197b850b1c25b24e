"""Blocking client side of the bidirectional ``Session`` RPC.

Requests go through a queue that gRPC drains on its own thread, so ``cancel_turn()`` (from
any thread, e.g. a signal handler or a UI thread) is sent at once, even while the caller is
blocked reading tokens. Responses are read by whoever iterates ``send()``.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Unpack

import grpc

from tokenwire.clients import convert
from tokenwire.clients import results as r
from tokenwire.clients.content import Content
from tokenwire.clients.convert import GenerationOptions
from tokenwire.clients.errors import TokenwireError, UnavailableError, from_rpc_error, from_status
from tokenwire.v1 import generation_pb2 as gen

_CANCEL_TURN = gen.SessionRequest(cancel_turn=gen.SessionCancelTurn())
_CLOSE = gen.SessionRequest(close=gen.SessionClose())


class SyncSession:
    """An open conversation. One turn at a time: iterate ``send()`` to the end (or break out
    of it, which cancels the turn) before the next ``send()``."""

    def __init__(
        self,
        method: Callable[..., Any],
        opening: gen.SessionRequest,
        metadata: Sequence[tuple[str, str]],
        default_n: int,
        timeout: float | None,
    ) -> None:
        self._requests: queue.Queue[gen.SessionRequest | None] = queue.Queue()
        self._requests.put(opening)
        self._default_n = default_n
        self._pending_ends = 0  # TurnEnds still expected for the running turn
        self._turn_seq = 0
        self._closed = False
        self._responses = method(self._request_iterator(), metadata=metadata, timeout=timeout)
        self.info = self._wait_opened()

    @property
    def closed(self) -> bool:
        """True once the session was closed by either side."""
        return self._closed

    @property
    def session_id(self) -> str:
        return self.info.session_id

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request_iterator(self) -> Iterator[gen.SessionRequest]:
        while (request := self._requests.get()) is not None:
            yield request

    def _next(self) -> gen.SessionResponse | None:
        """The next server message; None once the server ended the stream cleanly."""
        try:
            response: gen.SessionResponse = next(self._responses)
        except StopIteration:
            self._end_requests()
            return None
        except grpc.RpcError as err:
            self._end_requests()
            raise from_rpc_error(err) from err
        return response

    def _end_requests(self) -> None:
        if not self._closed:
            self._closed = True
            self._requests.put(None)

    def _wait_opened(self) -> r.SessionInfo:
        while (response := self._next()) is not None:
            if response.WhichOneof("message") == "opened":
                event = convert.session_event(response)
                assert isinstance(event, r.SessionInfo)
                return event
        raise UnavailableError("the server ended the session before opening it")

    # ----------------------------------------------------------------------------- turns

    def send(
        self,
        user_message: Content | None = None,
        *,
        text: str | None = None,
        token_ids: Sequence[int] | None = None,
        **options: Unpack[GenerationOptions],
    ) -> Iterator[r.SessionEvent]:
        """Run one turn: yields TurnStart, TextDelta*, one TurnEnd per choice (and any
        Notice). A failed turn raises its ``TokenwireError``; the session stays usable.

        ``user_message`` is a chat message (a string, or ordered parts: strings and
        ``ImagePart``s, for a vision-language model); ``text``/``token_ids`` append raw input.
        ``options`` override the session defaults for this turn only.
        """
        request = convert.session_turn(user_message, text, token_ids, options)
        return self._run_turn(request, options.get("n") or self._default_n)

    def _run_turn(self, request: gen.SessionRequest, n: int) -> Iterator[r.SessionEvent]:
        if self._closed:
            raise UnavailableError("the session is closed")
        self._abandon_turn()  # a previous turn left unfinished is cancelled first
        self._turn_seq += 1
        seq = self._turn_seq
        self._pending_ends = n
        self._requests.put(request)
        try:
            while self._turn_seq == seq and self._pending_ends > 0:
                event = self._read_turn_event()
                if event is not None:
                    yield event
        finally:
            if self._turn_seq == seq:
                self._abandon_turn()

    def _read_turn_event(self) -> r.SessionEvent | None:
        response = self._next()
        if response is None:
            self._pending_ends = 0
            raise UnavailableError("the server ended the session")
        if response.WhichOneof("message") == "turn_end":
            self._pending_ends -= 1
            if response.turn_end.HasField("error"):
                self._pending_ends = 0
                raise from_status(response.turn_end.error)
        event = convert.session_event(response)
        return None if isinstance(event, r.SessionInfo) else event

    def _abandon_turn(self) -> None:
        """Cancel the running turn, if any, and discard its remaining messages."""
        if self._pending_ends <= 0:
            return
        self.cancel_turn()
        try:
            while self._pending_ends > 0:
                self._read_turn_event()
        except TokenwireError:
            self._pending_ends = 0

    def cancel_turn(self) -> None:
        """Ask the server to stop the running turn (safe from any thread). Its choices end
        with finish_reason ``"cancelled"``; iterate on to receive them."""
        if self._pending_ends > 0 and not self._closed:
            self._requests.put(_CANCEL_TURN)

    def close(self) -> None:
        """Close the session (frees its KV cache on the server) and wait for the stream."""
        if self._closed:
            return
        self.cancel_turn()  # the server would otherwise finish a running turn first
        self._requests.put(_CLOSE)
        self._end_requests()
        self._pending_ends = 0
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass
