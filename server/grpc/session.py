"""The bidirectional ``Session`` RPC.

A reader task consumes client messages while a turn task streams the running turn, so a
CancelTurn never waits behind generation: it aborts the turn's engine request, which ends
with CANCELLED within one engine step. Everything the client sees goes through one queue.
Per-turn errors travel in-band (``TurnEnd.error``) and the session goes on.

Each turn is a request of the key's tenant as the table is *now* (a key-file reload reaches
open sessions): admitted and charged as that tenant; a model it may no longer use refuses the
turn in-band (NOT_FOUND, as for an unknown model); a revoked key ends the session
UNAUTHENTICATED, as a new call would end, freeing its KV blocks and session slot. A running
turn finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from tokenwire.runtime.engine.protocol import EngineClient
from tokenwire.server.grpc import convert
from tokenwire.server.grpc.adapters import resolve_model
from tokenwire.server.grpc.auth import bearer_token
from tokenwire.server.grpc.call_context import identify
from tokenwire.server.grpc.errors import (
    ServiceError,
    abort,
    invalid_parameter,
    to_service_error,
)
from tokenwire.server.grpc.guard import checked_messages
from tokenwire.server.grpc.session_messages import (
    notice,
)
from tokenwire.server.grpc.session_state import SessionState, resumed
from tokenwire.server.grpc.session_turns import Out, SessionTurns
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool
from tokenwire.server.telemetry.core import Telemetry
from tokenwire.server.tenants.limits import ModelNotAllowed
from tokenwire.server.tenants.registry import Caller, TenantRegistry
from tokenwire.v1 import errors_pb2
from tokenwire.v1 import generation_pb2 as pb


class SessionHandler:
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        limits: convert.Limits,
        tokenizers: TokenizerPool | None,
        max_sessions: int,
        idle_timeout: float,
        telemetry: Telemetry,
        tenants: TenantRegistry | None = None,
    ) -> None:
        self.engine = engine
        self.tenants = tenants or TenantRegistry()
        self.tokenizers = tokenizers
        self.telemetry = telemetry
        self.model_name = model_name
        self.limits = limits
        self.max_sessions = max_sessions
        self.idle_timeout = idle_timeout
        self._open: dict[str, Out] = {}

    @property
    def num_open(self) -> int:
        return len(self._open)

    def notify_draining(self) -> None:
        for out in self._open.values():
            out.put_nowait(notice(pb.NOTICE_KIND_DRAINING, "the server is shutting down"))

    async def run(
        self, requests: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionResponse]:
        requests = checked_messages(requests)
        try:
            who = identify(context, self.tenants)
            state = await self._open_session(requests, who)
            lease = self.tenants.open_session(who)  # the tenant's max_sessions, last
        except Exception as exc:
            self.telemetry.refused(exc)
            await abort(context, to_service_error(exc))
        out: Out = asyncio.Queue()
        self._open[state.session_id] = out
        session = SessionTurns(self, state, out, bearer_token(context.invocation_metadata()))
        reader = asyncio.create_task(session.read(requests))
        try:
            yield pb.SessionResponse(
                opened=pb.SessionOpened(
                    session_id=state.session_id,
                    model=state.model or self.model_name,
                    max_context_tokens=self.engine.info.max_model_len,
                )
            )
            while (message := await out.get()) is not None:
                yield message
            if session.failure is not None:  # e.g. an undecodable client message
                await abort(context, session.failure)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            await session.close()
            del self._open[state.session_id]
            lease.release()

    async def _open_session(self, requests: Any, who: Caller) -> SessionState:
        first = await anext(aiter(requests), None)
        if first is None or first.WhichOneof("message") != "open":
            raise invalid_parameter("open", "the first message of a session must be Open")
        if not who.tenant.allows_model(first.open.model or self.model_name):
            raise ModelNotAllowed(who.name, first.open.model or self.model_name)
        # The session binds the adapter its Open names for every turn (None: the base model).
        lora = resolve_model(self.engine, self.model_name, first.open.model)
        if len(self._open) >= self.max_sessions:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                errors_pb2.ERROR_REASON_TOO_MANY_SESSIONS,
                f"the server holds {self.max_sessions} sessions, its limit",
                retry_after=5.0,
            )
        # Validate the defaults once so a bad Open fails the call, not every turn.
        convert.sampling_params(
            first.open.sampling,
            first.open.stopping,
            first.open.output,
            self.limits,
            self.engine.info.default_sampling,
        )
        session_id = uuid.uuid4().hex
        holder_id = f"session/{who.namespace}/{session_id}"
        return resumed(SessionState(session_id, holder_id, first.open, lora))
