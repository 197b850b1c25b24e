"""The typed Python clients against a real server: unary == assembled stream, sessions with
cached context and CancelTurn, typed errors; the engine is idle afterwards."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from server_harness import ServerHarness

from tokenwire.clients import results as r
from tokenwire.clients.async_client import AsyncClient
from tokenwire.clients.client import Client
from tokenwire.clients.convert import assemble
from tokenwire.clients.errors import (
    ContextLengthExceededError,
    InvalidArgumentError,
    ModelNotFoundError,
)

PROMPT = [5, 17, 99, 230, 7, 41, 300, 12, 8, 77, 150]


def test_unary_equals_assembled_stream(harness: ServerHarness) -> None:
    with Client(harness.target, timeout=60) as client:
        unary = client.generate(PROMPT, max_tokens=12, temperature=0.0, n=2, seed=3)
        streamed = assemble(
            list(client.stream(PROMPT, max_tokens=12, temperature=0.0, n=2, seed=3))
        )
    assert [c.token_ids for c in unary.choices] == [c.token_ids for c in streamed.choices]
    assert all(len(c.token_ids) == 12 or c.finish_reason == "eos" for c in unary.choices)
    assert unary.usage.prompt_tokens == len(PROMPT)
    harness.assert_idle()


def test_typed_errors(harness: ServerHarness) -> None:
    with Client(harness.target, timeout=60) as client:
        with pytest.raises(InvalidArgumentError) as bad:
            client.generate(PROMPT, top_p=0.0)
        assert bad.value.param == "top_p" and bad.value.reason == "INVALID_PARAMETER"
        with pytest.raises(ContextLengthExceededError):
            client.generate(PROMPT, max_tokens=10_000)
        with pytest.raises(ModelNotFoundError):
            client.generate(PROMPT, model="nope")
    harness.assert_idle()


def test_session_reuses_context_and_cancels_a_turn(harness: ServerHarness) -> None:
    with (
        Client(harness.target, timeout=60) as client,
        client.session(temperature=0.0, max_tokens=6) as session,
    ):
        first = list(session.send(token_ids=PROMPT * 2))
        second = list(session.send(token_ids=[40, 41, 42]))
        started = next(e for e in second if isinstance(e, r.TurnStart))
        assert started.cached_tokens >= 16  # the first turn's full blocks were kept
        assert any(isinstance(e, r.TurnEnd) for e in first)
        turn = session.send(token_ids=[50], max_tokens=200, ignore_eos=True)
        cancelled = threading.Event()
        ends = []
        for event in turn:
            if isinstance(event, r.TextDelta) and not cancelled.is_set():
                session.cancel_turn()
                cancelled.set()
            if isinstance(event, r.TurnEnd):
                ends.append(event)
        assert [e.finish_reason for e in ends] == ["cancelled"]
        again = list(session.send(token_ids=[60], max_tokens=3))
        assert next(e.finish_reason for e in again if isinstance(e, r.TurnEnd)) in ("length", "eos")
    harness.assert_idle()


def test_async_client_stream_and_cancel(harness: ServerHarness) -> None:
    async def scenario() -> list[str]:
        async with AsyncClient(harness.target, timeout=60) as client:
            reasons = []
            cancelled = []
            async for event in client.stream(
                PROMPT, max_tokens=200, ignore_eos=True, request_id="cancel-me", temperature=0.0
            ):
                if isinstance(event, r.TextDelta) and not cancelled:
                    cancelled.append(await client.cancel("cancel-me"))
                if isinstance(event, r.ChoiceEnd):
                    reasons.append(event.finish_reason)
            assert cancelled == [True]
            assert not await client.cancel("cancel-me")  # finished: nothing to cancel
            return reasons

    assert asyncio.run(scenario()) == ["cancelled"]
    harness.assert_idle()


def test_round_robin_spreads_calls_over_every_address(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """``load_balancing="round_robin"`` over a target that resolves to two servers (what a
    headless Service gives) sends calls to both; the default (pick_first) sticks to one."""
    counters = [_Finished(), _Finished()]
    servers = [ServerHarness(tiny_model_factory("llama"), observer=c).start() for c in counters]
    try:
        target = "ipv4:" + ",".join(s.target for s in servers)
        for policy, expect_both in (("round_robin", True), (None, False)):
            before = [c.count for c in counters]
            with Client(target, load_balancing=policy) as client:
                for _ in range(6):
                    client.generate([5, 6, 7], max_tokens=1)
            counts = [c.count - b for c, b in zip(counters, before, strict=True)]
            assert sum(counts) == 6
            assert (min(counts) > 0) == expect_both, (policy, counts)
    finally:
        for server in servers:
            server.stop()


class _Finished:
    """Counts the requests a server's engine finished (an ``EngineObserver``)."""

    def __init__(self) -> None:
        self.count = 0

    def on_step(self, stats: object) -> None:
        pass

    def on_request_finished(self, stats: object) -> None:
        self.count += 1
