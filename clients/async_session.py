"""asyncio client side of the bidirectional ``Session`` RPC.

A reader task moves every server message into a queue as soon as it arrives, and writes are
independent of reads, so ``cancel_turn()`` from another task is never stuck behind
generation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeAlias, Unpack

import grpc

from tokenwire.clients import convert
from tokenwire.clients import results as r
from tokenwire.clients.convert import GenerationOptions
from tokenwire.clients.errors import TokenwireError, UnavailableError, from_rpc_error, from_status
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
    ) -> None:
        self._method = method
        self._opening = opening
        self._metadata = tuple(metadata)
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
        self._call = self._method(metadata=self._metadata, timeout=self._timeout)
        self._reader = asyncio.create_task(self._read_loop())
        await self._write(self._opening)
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
            self._inbox.put_nowait(from_rpc_error(err))
        finally:
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
        user_message: str | None = None,
        *,
        text: str | None = None,
        token_ids: Sequence[int] | None = None,
        **options: Unpack[GenerationOptions],
    ) -> AsyncIterator[r.SessionEvent]:
        """Run one turn: yields TurnStart, TextDelta*, one TurnEnd per choice (and any
        Notice). A failed turn raises its ``TokenwireError``; the session stays usable."""
        request = convert.session_turn(user_message, text, token_ids, options)
        return self._run_turn(request, options.get("n") or self._default_n)

    async def _run_turn(self, request: gen.SessionRequest, n: int) -> AsyncIterator[r.SessionEvent]:
        if self._closed or self._call is None:
            raise UnavailableError("the session is not open")
        await self._abandon_turn()  # a previous turn left unfinished is cancelled first
        self._turn_seq += 1
        seq = self._turn_seq
        self._pending_ends = n
        if not await self._write(request):
            self._pending_ends = 0
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
