"""asyncio client side of the bidirectional ``Session`` RPC.

A reader task moves every server message into a queue as soon as it arrives, and writes are
independent of reads, so ``cancel_turn()`` from another task is never stuck behind
generation.

Affinity: every stream of a session carries ``x-session-id`` metadata (``session_key``, one
per session object, kept across reconnects) so a gateway's consistent hashing keeps the
conversation on one replica. Reconnect: when the stream is lost (the replica died or
drained: UNAVAILABLE, or the stream ended) the next turn reopens the session with its
transcript (``session_transcript``) and first yields ``Notice("reconnected", why)``; a turn
cut off mid-generation is run again once on the new stream, after that notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeAlias, Unpack

import grpc

from tokenwire.clients import convert
from tokenwire.clients import results as r
from tokenwire.clients.content import Content
from tokenwire.clients.convert import GenerationOptions
from tokenwire.clients.errors import TokenwireError, UnavailableError, from_rpc_error, from_status
from tokenwire.clients.session_transcript import Transcript
from tokenwire.v1 import generation_pb2 as gen

_CANCEL_TURN = gen.SessionRequest(cancel_turn=gen.SessionCancelTurn())
_CLOSE = gen.SessionRequest(close=gen.SessionClose())
_CLOSE_GRACE_S = 10.0
_Item: TypeAlias = "gen.SessionResponse | TokenwireError | None"  # None: the stream ended


class AsyncSession:
    """An open conversation; use as ``async with client.session(...) as session``. One turn
    at a time: iterate ``send()`` to the end (or ``aclose()`` it, which cancels the turn)."""

    def __init__(
        self,
        method: Callable[..., Any],
        opening: gen.SessionRequest,
        metadata: Sequence[tuple[str, str]],
        default_n: int,
        timeout: float | None,
        session_key: str | None = None,
        reconnect: bool = True,
    ) -> None:
        self._method = method
        self._opening = opening
        self.session_key = session_key or uuid.uuid4().hex
        self._metadata = (*metadata, ("x-session-id", self.session_key))
        self.reconnect = reconnect
        self._transcript = Transcript()
        self._user_closed = False
        self._lost: str | None = None  # why the stream ended (it was not closed by us)
        self._timeout = timeout
        self._default_n = default_n
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._inbox: asyncio.Queue[_Item] = asyncio.Queue()
        self._write_lock = asyncio.Lock()
        self._pending_ends = 0
        self._turn_seq = 0
        self._closed = False
        self.info: r.SessionInfo | None = None

    @property
    def closed(self) -> bool:
        """True once the session was closed by either side."""
        return self._closed

    @property
    def session_id(self) -> str:
        return self.info.session_id if self.info else ""

    async def __aenter__(self) -> AsyncSession:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> r.SessionInfo:
        """Start the stream and wait for the server's Opened."""
        return await self._open(self._opening)

    async def _open(self, opening: gen.SessionRequest) -> r.SessionInfo:
        self._call = self._method(metadata=self._metadata, timeout=self._timeout)
        self._inbox = asyncio.Queue()
        self._closed, self._lost, self._pending_ends = False, None, 0
        self._reader = asyncio.create_task(self._read_loop())
        await self._write(opening)
        while (response := await self._next()) is not None:
            event = convert.session_event(response)
            if isinstance(event, r.SessionInfo):
                self.info = event
                return event
        raise UnavailableError("the server ended the session before opening it")

    async def _read_loop(self) -> None:
        try:
            while (response := await self._call.read()) is not grpc.aio.EOF:
                self._inbox.put_nowait(response)
        except grpc.RpcError as err:
            error = from_rpc_error(err)
            self._lost = str(error)
            self._inbox.put_nowait(error)
        finally:
            if self._lost is None:
                self._lost = "the server ended the stream"
            self._inbox.put_nowait(None)

    async def _next(self) -> gen.SessionResponse | None:
        """The next server message; None (sticky) once the stream ended; raises its error."""
        item = await self._inbox.get()
        if item is None or isinstance(item, TokenwireError):
            self._closed = True
            self._inbox.put_nowait(None)  # every later reader sees the end too
        if isinstance(item, TokenwireError):
            raise item
        return item

    async def _write(self, request: gen.SessionRequest) -> bool:
        """Send one message; False when the stream is already finished or half-closed."""
        async with self._write_lock:
            try:
                await self._call.write(request)
            except (grpc.RpcError, asyncio.InvalidStateError):
                return False
            return True

    # ----------------------------------------------------------------------------- turns

    def send(
        self,
        user_message: Content | None = None,
        *,
        text: str | None = None,
        token_ids: Sequence[int] | None = None,
        **options: Unpack[GenerationOptions],
    ) -> AsyncIterator[r.SessionEvent]:
        """Run one turn: yields TurnStart, TextDelta*, one TurnEnd per choice (and any
        Notice). A failed turn raises its ``TokenwireError``; the session stays usable."""
        request = convert.session_turn(user_message, text, token_ids, options)
        return self._turn_with_reconnect(request, options.get("n") or self._default_n)

    def _can_reconnect(self) -> bool:
        return self.reconnect and not self._user_closed and self._transcript.replayable

    async def _reconnect(self) -> r.Notice:
        old, why = self.session_id, self._lost or "the stream ended"
        if self._reader is not None:
            self._call.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        info = await self._open(self._transcript.opening(self._opening))
        text = f"session {old} was lost ({why}); reopened as {info.session_id}: it recomputes"
        return r.Notice("reconnected", text)

    async def _turn_with_reconnect(
        self, request: gen.SessionRequest, n: int
    ) -> AsyncIterator[r.SessionEvent]:
        if self._call is None or self._user_closed:
            raise UnavailableError("the session is not open")
        if self._closed and self._can_reconnect():
            yield await self._reconnect()
        self._transcript.start(request.turn)
        try:
            async for event in self._run_turn(request, n):
                yield event
        except UnavailableError:
            if not (self._closed and self._can_reconnect()):
                raise
            yield await self._reconnect()  # cut off mid-turn: once more on the new stream
            self._transcript.start(request.turn)
            async for event in self._run_turn(request, n):
                yield event
        except GeneratorExit:  # left early: the turn was cancelled, its reply so far stays
            self._transcript.commit()
            raise
        self._transcript.commit()

    async def _run_turn(self, request: gen.SessionRequest, n: int) -> AsyncIterator[r.SessionEvent]:
        if self._closed or self._call is None:
            raise UnavailableError("the session is not open")
        await self._abandon_turn()  # a previous turn left unfinished is cancelled first
        self._turn_seq += 1
        seq = self._turn_seq
        self._pending_ends = n
        if not await self._write(request):
            self._pending_ends = 0
            self._closed = True  # the stream is finished, whether or not its end was read
            self._lost = self._lost or "the stream was finished"
            raise UnavailableError("the session is closed")
        try:
            while self._turn_seq == seq and self._pending_ends > 0:
                event = await self._read_turn_event()
                if event is not None:
                    yield event
        finally:
            if self._turn_seq == seq:
                await self._abandon_turn()

    async def _read_turn_event(self) -> r.SessionEvent | None:
        response = await self._next()
        if response is None:
            self._pending_ends = 0
            raise UnavailableError("the server ended the session")
        if response.WhichOneof("message") == "turn_end":
            self._pending_ends -= 1
            if response.turn_end.HasField("error"):
                self._pending_ends = 0
                raise from_status(response.turn_end.error)
        event = convert.session_event(response)
        if isinstance(event, r.TextDelta):
            self._transcript.reply(event.index, event.text, event.token_ids)
        return None if isinstance(event, r.SessionInfo) else event

    async def _abandon_turn(self) -> None:
        if self._pending_ends <= 0:
            return
        await self.cancel_turn()
        try:
            while self._pending_ends > 0:
                await self._read_turn_event()
        except TokenwireError:
            self._pending_ends = 0

    async def cancel_turn(self) -> None:
        """Ask the server to stop the running turn. Its choices end with finish_reason
        ``"cancelled"``; iterate on to receive them."""
        if self._pending_ends > 0 and not self._closed:
            await self._write(_CANCEL_TURN)

    async def close(self) -> None:
        """Close the session (frees its KV cache on the server) and wait for the stream."""
        self._user_closed = True
        if self._call is None:
            return
        if not self._closed:
            await self.cancel_turn()  # the server would otherwise finish a running turn first
            self._closed = True
            self._pending_ends = 0
            if await self._write(_CLOSE):
                async with self._write_lock:
                    with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
                        await self._call.done_writing()
        if self._reader is not None:
            done, _ = await asyncio.wait({self._reader}, timeout=_CLOSE_GRACE_S)
            if not done:  # the server did not end the stream: stop waiting for it
                self._call.cancel()
                await asyncio.gather(self._reader, return_exceptions=True)
