"""A session's messages and turns: the reader of client messages and the task that runs
one turn at a time (``server/grpc/session.py`` opens, registers and closes the session)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import grpc

from tokenwire.runtime.front.request_stream import RequestFailed, RequestFinished
from tokenwire.runtime.outputs import ChoiceDelta, RequestStarted
from tokenwire.server.grpc import convert
from tokenwire.server.grpc.auth import UNAUTHENTICATED
from tokenwire.server.grpc.errors import (
    ServiceError,
    invalid_parameter,
    model_not_found,
    to_service_error,
)
from tokenwire.server.grpc.send_limit import check_size
from tokenwire.server.grpc.session_messages import (
    notice,
    turn_delta,
    turn_ends,
    turn_error,
    turn_started,
)
from tokenwire.server.grpc.session_state import SessionState
from tokenwire.server.telemetry.record import RequestRecord
from tokenwire.server.tenants.limits import Lease, ModelNotAllowed
from tokenwire.server.tenants.registry import Caller
from tokenwire.v1 import errors_pb2
from tokenwire.v1 import generation_pb2 as pb

if TYPE_CHECKING:  # the handler builds this class: a typing-only import back
    from tokenwire.server.grpc.session import SessionHandler

# What the client is sent, in order (None: the end of the call).
Out = asyncio.Queue[pb.SessionResponse | None]


class SessionTurns:
    """One open session: reads its client messages and runs its turns, one at a time."""

    def __init__(
        self, handler: SessionHandler, state: SessionState, out: Out, token: str | None
    ) -> None:
        self.handler = handler
        self._token = token  # the caller's key, looked up again for every turn; never shown
        self.engine = handler.engine
        self.state = state
        self.out = out
        self.turn_task: asyncio.Task[None] | None = None
        self.turn_request: str | None = None
        self.cancel_pending = False  # CancelTurn came while the prompt was being tokenized
        self.failure: ServiceError | None = None  # ends the call once the queue is drained

    async def read(self, requests: Any) -> None:
        """Consume client messages until Close, half-close or the idle timeout."""
        iterator = aiter(requests)
        pending: asyncio.Task[pb.SessionRequest | None] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(_next_or_none(iterator))
                # The idle clock runs only while no turn runs, and restarts when one ends.
                turn = self.turn_task if self.turn_task and not self.turn_task.done() else None
                waits: set[asyncio.Future[Any]] = {pending} if turn is None else {pending, turn}
                done, _ = await asyncio.wait(
                    waits,
                    timeout=None if turn is not None else self.handler.idle_timeout,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if pending not in done:
                    if turn is not None:
                        continue  # the turn ended: start the idle clock
                    self._notice(pb.NOTICE_KIND_IDLE_TIMEOUT, "no turn within the idle timeout")
                    break
                try:
                    message = pending.result()
                except ServiceError as exc:
                    self.failure = exc
                    break
                pending = None
                if message is None or not self._handle(message):
                    break
            if self.turn_task is not None and self.failure is None:
                # let a running turn finish before closing
                await self.turn_task
        finally:
            if pending is not None:
                pending.cancel()
            self.out.put_nowait(None)

    def _handle(self, message: pb.SessionRequest) -> bool:
        kind = message.WhichOneof("message")
        if kind == "close":
            return False
        if kind == "cancel_turn":
            if self.turn_request is not None:
                self.engine.abort(self.turn_request)
            elif self.turn_task is not None and not self.turn_task.done():
                self.cancel_pending = True  # the turn it follows is not in the engine yet
        elif kind == "turn":
            self.state.turns += 1
            if self.turn_task is not None and not self.turn_task.done():
                self._turn_error(
                    self.state.turns,
                    ServiceError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        errors_pb2.ERROR_REASON_TURN_IN_PROGRESS,
                        "a turn is already running: wait for its TurnEnd or send CancelTurn",
                    ),
                )
            else:
                who = self.handler.tenants.identify(self._token)  # the table as of now
                if who is None:  # a reload revoked the key since the session opened
                    self.failure = UNAUTHENTICATED
                    return False
                self.cancel_pending = False  # a CancelTurn cancels the turn it follows
                self.turn_task = asyncio.create_task(
                    self._turn(message.turn, self.state.turns, who)
                )
        else:
            self._turn_error(
                self.state.turns,
                invalid_parameter("message", "Open may only be sent once, as the first message"),
            )
        return True

    async def _turn(self, turn: pb.SessionTurn, number: int, who: Caller) -> None:
        state, engine, telemetry = self.state, self.engine, self.handler.telemetry
        request_id = f"{state.holder_id}/turn-{number}"
        record = self._turn_record(turn, number, request_id, who)
        status = "CANCELLED"  # unless the turn ends otherwise
        lease = None
        try:
            model = state.open.model or self.handler.model_name
            if not who.tenant.allows_model(model):  # a reload withdrew it since Open
                raise ModelNotAllowed(who.name, model)
            lease = self.handler.tenants.admit(who)  # each turn is a request
            if state.lora is not None:
                telemetry.select_model(record, state.lora.lora_name)
                if engine.get_lora(state.lora.lora_name) != state.lora:  # unloaded since Open
                    raise model_not_found(state.lora.lora_name)
            salt = who.cache_salt(state.open.cache_salt or None)
            prompt, messages, images = await state.prompt_for(self.handler.tokenizers, turn, salt)
            params = convert.sampling_params(
                *state.options(turn), self.handler.limits, engine.info.default_sampling
            )
            telemetry.describe(record, params, messages is not None, None)
            await engine.check_constraint(params)  # grammar work off the event loop
            stream = engine.add_request(
                request_id,
                None,
                prompt,
                params,
                priority=who.tenant.clamp_priority(0),
                cache_salt=salt,
                hold_as=state.holder_id,
                lora_request=state.lora,
                images=images,
            )
            telemetry.admit(record, params.n)
        except Exception as exc:
            if lease is not None:
                lease.release()
            telemetry.refused(exc)
            err = to_service_error(exc, request_id)
            self._turn_error(number, err)
            telemetry.end(record, err.code.name)
            return
        self.turn_request = request_id
        if self.cancel_pending:  # CancelTurn arrived before the turn reached the engine
            engine.abort(request_id)
        try:
            await self._stream_turn(stream, number, prompt, messages, params.logprobs, lease)
            status = "OK"
        except Exception as exc:
            err = to_service_error(exc, request_id)
            status = err.code.name
            self._turn_error(number, err)
        finally:
            self.turn_request = None
            engine.abort(request_id)
            lease.release()
            telemetry.end(record, status)

    def _turn_record(
        self, turn: pb.SessionTurn, number: int, request_id: str, who: Caller
    ) -> RequestRecord:
        """The turn's telemetry record (its span under the turn's traceparent), bound to this
        turn's task only."""
        telemetry = self.handler.telemetry
        parent = telemetry.parent_from(turn.traceparent, turn.tracestate)
        record = telemetry.begin(
            f"{self.state.session_id}/turn-{number}", request_id, "session_turn", parent
        )
        telemetry.set_tenant(record, who.name)
        telemetry.bind(record)
        return record

    async def _stream_turn(
        self,
        stream: Any,
        number: int,
        prompt: list[int],
        messages: list[dict[str, Any]] | None,
        num_top: int | None,
        lease: Lease,
    ) -> None:
        def put(message: pb.SessionResponse) -> None:
            check_size(message, self.handler.limits.max_response_bytes)  # fails the turn
            self.out.put_nowait(message)

        async for item in stream:
            if isinstance(item, RequestStarted):
                put(turn_started(number, self.state.session_id, item))
            elif isinstance(item, ChoiceDelta):
                lease.charge(len(item.token_ids))
                if item.text or item.token_ids:
                    put(turn_delta(number, item, num_top))
            elif isinstance(item, RequestFinished):
                for message in turn_ends(number, item.output):
                    put(message)
                first = item.output.outputs[0]
                self.state.commit(prompt, messages, first.text, first.token_ids)
                self.engine.on_holder_evicted(self.state.holder_id, self._evicted)
            elif isinstance(item, RequestFailed):
                raise item.error

    def _turn_error(self, number: int, err: ServiceError) -> None:
        self.out.put_nowait(turn_error(number, err))

    def _notice(self, kind: pb.NoticeKind, message: str) -> None:
        self.out.put_nowait(notice(kind, message))

    def _evicted(self) -> None:
        self._notice(
            pb.NOTICE_KIND_CONTEXT_EVICTED,
            "the session's KV cache was reclaimed; the next turn recomputes it",
        )

    async def close(self) -> None:
        """Abort a running turn and free the session's KV blocks."""
        if self.turn_task is not None and not self.turn_task.done():
            if self.turn_request is not None:
                self.engine.abort(self.turn_request)
            self.turn_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.turn_task
        self.engine.release_holder(self.state.holder_id)


async def _next_or_none(iterator: Any) -> Any:
    """The next client message, or None once the client half-closed."""
    try:
        return await anext(iterator)
    except StopAsyncIteration:
        return None
