"""The bidirectional Session RPC: KV reuse across turns, CancelTurn, in-band turn errors,
Close / half-close, idle timeout, the session limit and context eviction under pressure."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2
from grpc_helpers import Recorder, details_of, spy_on
from server_harness import ServerHarness

from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pb = generation_pb2
BLOCK = 16
GREEDY = common_pb2.SamplingOptions(temperature=0.0)


class Session:
    """A Session call driven from the test thread: send messages, read replies in order."""

    def __init__(self, target: grpc.Channel, **open_fields: Any) -> None:
        self._outbox: queue.Queue[pb.SessionRequest | None] = queue.Queue()
        stub = generation_pb2_grpc.GenerationServiceStub(target)
        self.call = stub.Session(iter(self._outbox.get, None))
        open_fields.setdefault("sampling", GREEDY)
        open_fields.setdefault(
            "stopping", common_pb2.StoppingOptions(max_tokens=6, ignore_eos=True)
        )
        self.send(open=pb.SessionOpen(**open_fields))

    def send(self, **message: Any) -> None:
        self._outbox.put(pb.SessionRequest(**message))

    def half_close(self) -> None:
        self._outbox.put(None)

    def recv(self) -> pb.SessionResponse:
        return next(self.call)

    def opened(self) -> pb.SessionOpened:
        return self.recv().opened

    def turn(self, ids: list[int], **options: Any) -> None:
        self.send(turn=pb.SessionTurn(token_ids=common_pb2.TokenIds(ids=ids), **options))

    def finish_turn(self) -> tuple[pb.TurnStarted, list[int], pb.TurnEnd]:
        """Read one n=1 turn to its TurnEnd: (started, generated ids, end)."""
        started, ids = pb.TurnStarted(), []
        while True:
            kind, msg = _unpack(self.recv())
            if kind == "turn_started":
                started = msg
            elif kind == "delta":
                ids.extend(msg.delta.token_ids)
            elif kind == "turn_end":
                return started, ids, msg
            else:
                raise AssertionError(f"unexpected {kind}: {msg}")

    def ended(self) -> bool:
        try:
            extra = self.recv()
        except StopIteration:
            return self.call.code() == grpc.StatusCode.OK
        raise AssertionError(f"stream still open: {extra}")


def _unpack(message: pb.SessionResponse) -> tuple[str, Any]:
    kind = message.WhichOneof("message")
    return kind, getattr(message, kind)


def ids(start: int, count: int) -> list[int]:
    return [3 + (start + 7 * i) % 500 for i in range(count)]


def unary(channel: grpc.Channel, prompt: list[int], max_tokens: int) -> list[int]:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    reply = stub.Generate(
        pb.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=prompt),
            sampling=GREEDY,
            cache_salt="unary",
            stopping=common_pb2.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
        )
    )
    return list(reply.choices[0].token_ids)


@pytest.fixture(scope="module")
def gate() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def harness_options(gate: Recorder) -> dict[str, Any]:
    return dict(observer=gate, max_sessions=3)


@pytest.fixture()
def channel(harness: ServerHarness) -> Iterator[grpc.Channel]:
    with harness.channel() as ch:
        yield ch


def test_turns_reuse_the_cached_transcript(harness: ServerHarness, channel: grpc.Channel) -> None:
    s = Session(channel, cache_salt="three-turns")
    assert s.opened().max_context_tokens == 256
    transcript: list[int] = []
    for number, new in enumerate([ids(0, 21), ids(1, 9), ids(2, 30)], start=1):
        previous = len(transcript)
        transcript += new
        s.turn(new)
        started, generated, end = s.finish_turn()
        assert (started.turn, end.turn, end.index) == (number, number, 0)
        assert started.prompt_tokens == len(transcript)
        # Everything computed last turn (its prompt + reply minus the last sampled token)
        # is reused, in whole blocks.
        expected_cached = max(previous - 1, 0) // BLOCK * BLOCK
        assert started.cached_tokens == expected_cached
        assert end.usage.cached_tokens == expected_cached
        assert end.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (end.usage.prompt_tokens, end.usage.completion_tokens) == (len(transcript), 6)
        assert generated == unary(channel, transcript, 6)
        transcript += generated
    assert harness.kv_report().num_held_blocks > 0  # the session holds its context
    s.send(close=pb.SessionClose())
    assert s.ended()
    harness.assert_idle()  # Close released the held blocks


def test_cache_salt_scopes_the_prefix_cache(harness: ServerHarness, channel: grpc.Channel) -> None:
    first_turn = ids(17, 40)
    cached = []
    for salt in ("salt-a", "salt-b", "salt-a"):
        s = Session(channel, cache_salt=salt)
        s.opened()
        s.turn(first_turn)
        started, _, _ = s.finish_turn()
        cached.append(started.cached_tokens)
        s.half_close()
        assert s.ended()
    assert cached == [0, 0, 32]  # only the same salt shares blocks (two full blocks)
    harness.assert_idle()


def test_half_close_ends_the_session_and_frees_it(
    harness: ServerHarness, channel: grpc.Channel
) -> None:
    s = Session(channel)
    s.opened()
    s.turn(ids(5, 20))
    s.finish_turn()
    assert harness.kv_report().num_held_blocks > 0
    s.half_close()
    assert s.ended()
    harness.assert_idle()


def test_cancel_turn_mid_decode(
    harness: ServerHarness, channel: grpc.Channel, gate: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    aborts = spy_on(monkeypatch, harness.engine, "abort")
    s = Session(channel)
    s.opened()
    gate.hold("/turn-1", nth=3)  # park the engine at the turn's third step
    s.turn(ids(9, 12), stopping=common_pb2.StoppingOptions(max_tokens=200))
    assert s.recv().HasField("turn_started")
    first = s.recv()
    assert first.HasField("delta") and first.delta.delta.token_ids
    assert gate.parked.wait(10)
    s.send(cancel_turn=pb.SessionCancelTurn())
    aborts.wait("/turn-1")  # the abort is queued while the engine is parked
    gate.release()
    _, generated, end = s.finish_turn()
    assert end.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    # The abort stops the turn: the three parked steps' tokens, plus any step the core ran
    # before the abort crossed the (asynchronous) ZMQ input socket; every token was streamed.
    kept = end.usage.completion_tokens
    assert kept == len(first.delta.delta.token_ids) + len(generated) and 3 <= kept < 200
    # The session goes on: the next turn continues the (cancelled) transcript.
    s.turn([42, 43])
    started, generated, end = s.finish_turn()
    assert started.turn == 2 and started.prompt_tokens == 12 + kept + 2
    assert end.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(generated) == 6
    s.half_close()
    assert s.ended()
    harness.assert_idle()


def test_invalid_turn_reports_in_band_and_the_session_goes_on(
    harness: ServerHarness, channel: grpc.Channel
) -> None:
    s = Session(channel)
    s.opened()
    s.turn(ids(3, 10), sampling=common_pb2.SamplingOptions(temperature=-1.0))
    kind, end = _unpack(s.recv())
    assert kind == "turn_end" and end.turn == 1
    assert end.error.code == code_pb2.INVALID_ARGUMENT
    info = error_details_pb2.ErrorInfo()
    assert end.error.details[0].Unpack(info)
    assert (info.reason, info.metadata["param"]) == ("INVALID_PARAMETER", "temperature")
    s.turn(ids(3, 10))
    started, generated, end = s.finish_turn()
    assert started.turn == 2 and started.prompt_tokens == 10
    assert not end.HasField("error") and len(generated) == 6
    s.send(close=pb.SessionClose())
    assert s.ended()
    harness.assert_idle()


def test_session_limit_is_resource_exhausted(harness: ServerHarness) -> None:
    with harness.channel() as channel:
        sessions = [Session(channel) for _ in range(3)]
        for s in sessions:
            s.opened()
        extra = Session(channel)
        with pytest.raises(grpc.RpcError) as err:
            extra.recv()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        info, details = details_of(err.value)
        assert info is not None and info.reason == "TOO_MANY_SESSIONS"
        assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in details)
        sessions[0].half_close()
        assert sessions[0].ended()
        replacement = Session(channel)  # a closed session's slot is free again
        assert replacement.opened().session_id
        for s in (*sessions[1:], replacement):
            s.half_close()
            assert s.ended()
    harness.assert_idle()


def test_idle_timeout_closes_the_session(tiny_model_factory: Callable[..., Path]) -> None:
    harness = ServerHarness(tiny_model_factory("llama"), session_idle_timeout=0.5).start()
    try:
        with harness.channel() as channel:
            s = Session(channel)
            s.opened()
            s.turn(ids(1, 8))
            s.finish_turn()
            # No further message: after the idle timeout (waiting is the feature here) the
            # server says why and ends the call.
            kind, notice = _unpack(s.recv())
            assert (kind, notice.kind) == ("notice", pb.NOTICE_KIND_IDLE_TIMEOUT)
            assert s.ended()
        harness.assert_idle()
    finally:
        harness.stop()


def test_context_eviction_under_memory_pressure(tiny_model_factory: Callable[..., Path]) -> None:
    # 8 usable blocks of 16 = one 128-token sequence; sessions may pin at most 4 blocks.
    harness = ServerHarness(tiny_model_factory("llama"), num_blocks=9, max_model_len=128)
    harness.start()
    try:
        with harness.channel() as channel:
            s = Session(channel)
            s.opened()
            first = ids(11, 40)
            s.turn(first)
            _, reply, _ = s.finish_turn()
            assert harness.kv_report().num_held_blocks == 3  # 45 computed tokens
            # A request that needs all 8 blocks: the idle session's context must go.
            big = ids(4, 100)
            assert len(unary(channel, big, 20)) == 20
            kind, notice = _unpack(s.recv())
            assert (kind, notice.kind) == ("notice", pb.NOTICE_KIND_CONTEXT_EVICTED)
            assert harness.kv_report().num_held_blocks == 0
            # The next turn recomputes the transcript and answers as a fresh request would.
            transcript = [*first, *reply, 77, 78]
            s.turn([77, 78])
            started, generated, end = s.finish_turn()
            assert started.prompt_tokens == len(transcript)
            assert not end.HasField("error")
            assert generated == unary(channel, transcript, 6)
            s.half_close()
            assert s.ended()
        harness.assert_idle()
    finally:
        harness.stop()


def test_with_a_host_kv_tier_the_context_moves_down_instead(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """The same pressure with a host KV tier (docs/kv-tiers.md): no CONTEXT_EVICTED notice;
    the session's blocks wait in host memory and the next turn loads them back, so it reports
    its transcript's full blocks as cached and answers as a fresh request would."""
    harness = ServerHarness(
        tiny_model_factory("llama"), num_blocks=9, max_model_len=128, kv_offloading_size=0.01
    )
    harness.start()
    try:
        with harness.channel() as channel:
            s = Session(channel)
            s.opened()
            first = ids(11, 40)
            s.turn(first)
            _, reply, _ = s.finish_turn()
            assert len(unary(channel, ids(4, 100), 20)) == 20  # needs every device block
            report = harness.kv_report()
            assert report.num_held_blocks == 0 and report.num_tier_held_blocks == 2
            transcript = [*first, *reply, 77, 78]
            s.turn([77, 78])  # the next message is this turn's: no notice came
            started, generated, end = s.finish_turn()
            assert started.prompt_tokens == len(transcript)
            assert started.cached_tokens == 32  # the 2 full blocks of the 45 computed tokens
            assert not end.HasField("error")
            assert generated == unary(channel, transcript, 6)
            s.half_close()
            assert s.ended()
        harness.assert_idle()  # no device block, no host slot held
    finally:
        harness.stop()
