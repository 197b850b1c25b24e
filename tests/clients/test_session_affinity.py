"""Affinity and reconnect of client Sessions (issue 28 item 4).

Every call of a Session (and a Generate given a ``session_key``) carries ``x-session-id``; a
Session whose replica is stopped reopens on the other replica with its transcript, tells the
caller why (``Notice("reconnected", ...)``) and answers exactly as an uninterrupted session
(greedy, same weights). Two real servers on loopback; the client's channel lists both."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from server_harness import ServerHarness

from tokenwire.clients import results as r
from tokenwire.clients.async_client import AsyncClient
from tokenwire.clients.client import Client
from tokenwire.clients.errors import UnavailableError

GREEDY: dict[str, Any] = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


async def _turn(session: Any, message: str) -> tuple[str, list[r.SessionEvent]]:
    events = [e async for e in session.send(message, **GREEDY)]
    text = "".join(e.text for e in events if isinstance(e, r.TextDelta))
    return text, events


def test_session_reconnects_to_another_replica(tiny_model_with_tokenizer: Path) -> None:
    a = ServerHarness(tiny_model_with_tokenizer, in_process=True).start()
    b = ServerHarness(tiny_model_with_tokenizer, in_process=True).start()
    try:

        async def run() -> None:
            async with AsyncClient(b.target) as direct, direct.session("") as ref:
                expected = [(await _turn(ref, m))[0] for m in ("Hello", "Go on")]
            # pick_first: the session opens on a (first in the list) until it is gone.
            async with AsyncClient(f"ipv4:{a.target},{b.target}") as client:
                session = client.session("")
                await session.open()
                assert a.server.sessions.num_open == 1 and b.server.sessions.num_open == 0
                first, _ = await _turn(session, "Hello")
                await asyncio.to_thread(a.stop)
                second, events = await _turn(session, "Go on")
                await session.close()
            notices = [e for e in events if isinstance(e, r.Notice)]
            assert notices and notices[0].kind == "reconnected" and events[0] is notices[0]
            assert "reopened as" in notices[0].message
            start = next(e for e in events if isinstance(e, r.TurnStart))
            assert start.prompt_tokens > 12  # the whole transcript was fed again
            assert [first, second] == expected

        asyncio.run(run())
        b.assert_idle()
    finally:
        b.stop()


def test_without_reconnect_the_caller_is_told(tiny_model_with_tokenizer: Path) -> None:
    a = ServerHarness(tiny_model_with_tokenizer, in_process=True).start()

    async def run() -> None:
        async with AsyncClient(a.target) as client:
            session = client.session("", reconnect=False)
            await session.open()
            await _turn(session, "Hello")
            await asyncio.to_thread(a.stop)
            with pytest.raises(UnavailableError):
                await _turn(session, "Go on")

    asyncio.run(run())


class _Recorder:
    """A bare grpc.aio server that records each call's metadata and refuses it."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    def handler(self) -> grpc.GenericRpcHandler:
        async def record(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.seen.append(dict(context.invocation_metadata()))
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "recorder")

        def make(kind: str) -> grpc.RpcMethodHandler:
            return getattr(grpc, f"{kind}_rpc_method_handler")(record)

        return grpc.method_handlers_generic_handler(
            "tokenwire.v1.GenerationService",
            {"Generate": make("unary_unary"), "Session": make("stream_stream")},
        )


def _sync_session(port: int) -> None:
    with Client(f"127.0.0.1:{port}", retry=None) as sync, pytest.raises(Exception):  # noqa: B017
        sync.session("", session_key="conv-8")


def test_calls_carry_x_session_id() -> None:
    recorder = _Recorder()

    async def run() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((recorder.handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with AsyncClient(f"127.0.0.1:{port}", retry=None) as client:
                session = client.session("", session_key="conv-7")
                with pytest.raises(Exception):  # noqa: B017 (the recorder refuses every call)
                    await session.open()
                with pytest.raises(Exception):  # noqa: B017
                    await client.generate("hi", session_key="conv-7")
                other = client.session("")
                with pytest.raises(Exception):  # noqa: B017
                    await other.open()
            await asyncio.to_thread(_sync_session, port)  # off the loop that serves
        finally:
            await server.stop(0)

    asyncio.run(run())
    keys = [m.get("x-session-id") for m in recorder.seen]
    assert keys[:2] == ["conv-7", "conv-7"]
    assert keys[2] and keys[2] not in ("conv-7", "conv-8")  # a fresh key per session
    assert keys[3] == "conv-8"
