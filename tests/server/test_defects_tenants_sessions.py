"""Defects #6 and #11 on a real grpc.aio server whose tenants come from a key file on disk.

#6: a key-file reload reaches Sessions opened before it. Every turn is checked against the
tenant table as it is now: a revoked key ends the session with UNAUTHENTICATED (as a new call
with that key would), a model withdrawn from the tenant refuses the turn in-band
(NOT_FOUND MODEL_NOT_FOUND, as for a model that does not exist: defects #7, no tenant oracle)
and a tightened rate limit refuses it in-band (RESOURCE_EXHAUSTED); the
session goes on after an in-band refusal.

#11: a CancelTurn written in the same burst as its Turn (so it may arrive while the turn's
chat template or text is still being rendered, before TurnStarted) cancels that turn, and only
that turn. Before the fix the plain burst lost the cancel about half the time; the gated test
holds tokenization until the CancelTurn has certainly been read, so it fails every time.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2
from grpc_helpers import details_of
from server_harness import ServerHarness

from tokenwire.runtime.front.frontend import Frontend
from tokenwire.server.tenants.config import hash_key, load_tenant_file
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pb = generation_pb2
TEAM, OTHER, NEW = "team-session-key", "other-session-key", "team-new-key"
MAX_TOKENS = 200


def _write(path: Path, team_key: str = TEAM, models: str = "[tiny]", limits: str = "{}") -> None:
    path.write_text(
        "tenants:\n"
        f"  - {{name: team, keys: ['{hash_key(team_key)}'], models: {models}, limits: {limits}}}\n"
        f"  - {{name: other, keys: ['{hash_key(OTHER)}']}}\n"
    )


class KeyedSession:
    """A Session call with a key; ``send`` writes its messages in one burst (the request
    iterator hands them to gRPC back to back, without waiting in between)."""

    def __init__(self, channel: grpc.Channel, key: str, **open_fields: Any) -> None:
        self._outbox: queue.Queue[list[pb.SessionRequest] | None] = queue.Queue()
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        burst = itertools.chain.from_iterable(iter(self._outbox.get, None))
        self.call = stub.Session(burst, metadata=(("authorization", f"Bearer {key}"),))
        open_fields.setdefault("sampling", common_pb2.SamplingOptions(temperature=0.0))
        open_fields.setdefault(
            "stopping", common_pb2.StoppingOptions(max_tokens=4, ignore_eos=True)
        )
        self.send(pb.SessionRequest(open=pb.SessionOpen(**open_fields)))
        assert next(self.call).HasField("opened")

    def send(self, *messages: pb.SessionRequest) -> None:
        self._outbox.put(list(messages))

    def turn(self, **fields: Any) -> pb.SessionRequest:
        if not {"text", "token_ids", "user_message"} & set(fields):
            fields["token_ids"] = common_pb2.TokenIds(ids=[5, 6, 7])
        return pb.SessionRequest(turn=pb.SessionTurn(**fields))

    def turn_end(self) -> pb.TurnEnd:
        """Read to the next TurnEnd (n=1), skipping TurnStarted and deltas."""
        for reply in self.call:
            if reply.HasField("turn_end"):
                return reply.turn_end
            assert reply.WhichOneof("message") in ("turn_started", "delta"), reply
        raise AssertionError(f"the session ended: {self.call.code()}")

    def close(self) -> None:
        self.send(pb.SessionRequest(close=pb.SessionClose()))
        self._outbox.put(None)
        assert list(self.call) == [] and self.call.code() == grpc.StatusCode.OK


def _reason(end: pb.TurnEnd) -> tuple[int, str]:
    info = error_details_pb2.ErrorInfo()
    assert end.error.details[0].Unpack(info)
    return end.error.code, info.reason


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    _write(path)
    return path


@pytest.fixture(scope="module")
def harness(tiny_model_with_tokenizer: Path, keys: Path) -> Iterator[ServerHarness]:
    h = ServerHarness(tiny_model_with_tokenizer)
    h.settings = dataclasses.replace(h.settings, tenants=load_tenant_file(keys))
    h.start()
    yield h
    h.stop()


def reload(harness: ServerHarness) -> bool:
    """What SIGHUP runs, on the server's loop."""

    async def go() -> bool:
        return harness.server.tenants.reload()

    return harness.run(go())


@pytest.fixture()
def channel(harness: ServerHarness, keys: Path) -> Iterator[grpc.Channel]:
    _write(keys)
    assert reload(harness)
    with harness.channel() as ch:
        yield ch


def test_a_revoked_key_ends_its_open_session(
    harness: ServerHarness, keys: Path, channel: grpc.Channel
) -> None:
    session = KeyedSession(channel, TEAM)
    session.send(session.turn())
    assert not session.turn_end().HasField("error")
    _write(keys, team_key=NEW)  # the team's key is replaced: TEAM is revoked
    assert reload(harness)
    session.send(session.turn())
    with pytest.raises(grpc.RpcError) as err:
        session.turn_end()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    info, _ = details_of(err.value)
    assert info is not None and info.reason == "API_KEY_INVALID"
    harness.assert_idle()  # the session's held KV blocks went with it
    with pytest.raises(grpc.RpcError) as err:
        KeyedSession(channel, TEAM)  # as a new session with that key is refused
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    fresh = KeyedSession(channel, NEW)
    fresh.send(fresh.turn())
    assert not fresh.turn_end().HasField("error")
    fresh.close()
    harness.assert_idle()


def test_a_withdrawn_model_and_a_new_limit_refuse_turns_in_band(
    harness: ServerHarness, keys: Path, channel: grpc.Channel
) -> None:
    session = KeyedSession(channel, TEAM)
    session.send(session.turn())
    assert not session.turn_end().HasField("error")
    _write(keys, models="[elsewhere]")
    assert reload(harness)
    session.send(session.turn())
    end = session.turn_end()
    assert _reason(end) == (code_pb2.NOT_FOUND, "MODEL_NOT_FOUND")
    _write(keys, limits="{requests_per_second: 0.01, burst: 1}")  # tiny back, one turn
    assert reload(harness)
    session.send(session.turn())
    assert not session.turn_end().HasField("error")  # the burst of one
    session.send(session.turn())
    end = session.turn_end()
    assert _reason(end) == (code_pb2.RESOURCE_EXHAUSTED, "RATE_LIMITED")
    session.close()  # refused turns never ended the session
    harness.assert_idle()


def test_cancel_turn_written_with_its_turn_cancels_it(
    harness: ServerHarness, channel: grpc.Channel
) -> None:
    stopping = common_pb2.StoppingOptions(max_tokens=MAX_TOKENS, ignore_eos=True)
    session = KeyedSession(channel, OTHER, stopping=stopping)
    cancel = pb.SessionRequest(cancel_turn=pb.SessionCancelTurn())
    session.send(session.turn(user_message="Tell me a long story about a cat"), cancel)
    end = session.turn_end()
    assert end.finish_reason == common_pb2.FINISH_REASON_CANCELLED and end.turn == 1
    assert end.usage.completion_tokens < MAX_TOKENS // 20, end.usage
    # Nothing runs any more (bounded: the core answers after every earlier command) ...
    assert not harness.kv_report(timeout=30).has_unfinished_requests
    # ... and the cancel was spent on that turn: the next one runs to its length.
    short = common_pb2.StoppingOptions(max_tokens=3, ignore_eos=True)
    session.send(session.turn(user_message="And a dog?", stopping=short))
    end = session.turn_end()
    assert end.finish_reason == common_pb2.FINISH_REASON_LENGTH and end.turn == 2
    assert end.usage.completion_tokens == 3
    session.close()
    harness.assert_idle(timeout=30)  # every stream ended, every KV block free


class TokenizerGate:
    """Holds the server's text tokenization (the real tokenizer, in its pool thread) until
    released, so a turn is certainly still before the engine when later messages arrive."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self._release = threading.Event(), threading.Event()
        real = Frontend.encode  # what the tokenizer pool's thread runs for a text turn

        def gated(frontend: Frontend, *args: Any) -> list[int]:
            self.entered.set()
            assert self._release.wait(30), "the gate was never released"
            return real(frontend, *args)

        monkeypatch.setattr(Frontend, "encode", gated)

    def release(self) -> None:
        self._release.set()


def test_cancel_turn_before_the_turn_reaches_the_engine_cancels_it(
    harness: ServerHarness, channel: grpc.Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window made wide: turn 1 is held in tokenization while its CancelTurn and a
    second Turn arrive; the second Turn's in-band TURN_IN_PROGRESS proves the CancelTurn
    before it was read before turn 1 reached the engine."""
    stopping = common_pb2.StoppingOptions(max_tokens=MAX_TOKENS, ignore_eos=True)
    session = KeyedSession(channel, OTHER, stopping=stopping)
    gate = TokenizerGate(monkeypatch)
    cancel = pb.SessionRequest(cancel_turn=pb.SessionCancelTurn())
    session.send(session.turn(text="A long story"), cancel, session.turn(text="Another"))
    refused = session.turn_end()
    assert refused.turn == 2 and refused.error.code == code_pb2.FAILED_PRECONDITION
    assert gate.entered.is_set()
    gate.release()
    end = session.turn_end()
    assert end.turn == 1 and end.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert end.usage.completion_tokens < MAX_TOKENS // 20, end.usage
    assert not harness.kv_report(timeout=30).has_unfinished_requests
    session.close()
    harness.assert_idle(timeout=30)
