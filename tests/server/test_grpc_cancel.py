"""Cancellation matrix: every way a request can end early frees its KV blocks, and requests
running beside it ("bystanders") still produce exactly their greedy tokens.

Determinism without sleeps: an engine observer parks the engine thread at a chosen step of
the victim request; the test acts (cancel, disconnect, ...) and waits until the server has
asked the engine to abort (a spy on ``AsyncEngine.abort``) before letting the engine go on.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_helpers import Recorder, Spy, delta_ids, spy_on
from grpc_helpers import greedy_request as request
from server_harness import ServerHarness

from tokenwire.runtime.outputs import FinishReason
from tokenwire.runtime.stats import RequestStats
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pb = generation_pb2
BYSTANDER_PROMPT = [9, 8, 7, 6, 5, 4, 3]
BYSTANDER_TOKENS = 200  # long enough to overlap every scenario (checked)


class Bystanders:
    """Greedy streams started before the scenario; ``check`` asserts their exact tokens."""

    def __init__(
        self, channel: grpc.Channel, name: str, expected: list[int], count: int = 1
    ) -> None:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        self.ids = [f"anon/bystander-{name}-{i}" for i in range(count)]
        self.expected = expected
        self.results: queue.Queue[list[int] | BaseException] = queue.Queue()
        self.threads = []
        for i in range(count):
            call = stub.GenerateStream(
                request(BYSTANDER_PROMPT, BYSTANDER_TOKENS, f"bystander-{name}-{i}")
            )
            assert next(call).HasField("start")  # running before the scenario starts
            thread = threading.Thread(target=self._collect, args=(call,))
            thread.start()
            self.threads.append(thread)

    def _collect(self, call: Any) -> None:
        try:
            self.results.put(delta_ids(call))
        except BaseException as exc:  # reported by check()
            self.results.put(exc)

    def check(self, recorder: Recorder) -> None:
        for thread in self.threads:
            thread.join(30)
        for _ in self.threads:
            result = self.results.get(timeout=1)
            assert result == self.expected
        assert recorder.parked_at is not None
        assert set(self.ids) <= set(recorder.parked_at.scheduled)  # they overlapped


@pytest.fixture(scope="module")
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def harness_options(recorder: Recorder) -> dict[str, Any]:
    return dict(observer=recorder, max_num_seqs=2, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def expected(harness: ServerHarness) -> list[int]:
    with harness.channel() as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        reply = stub.Generate(request(BYSTANDER_PROMPT, BYSTANDER_TOKENS))
    return list(reply.choices[0].token_ids)


@pytest.fixture()
def aborts(harness: ServerHarness, monkeypatch: pytest.MonkeyPatch) -> Spy:
    return spy_on(monkeypatch, harness.engine, "abort")


@pytest.fixture()
def channel(harness: ServerHarness) -> Iterator[grpc.Channel]:
    with harness.channel() as ch:
        yield ch


@pytest.fixture()
def stub(channel: grpc.Channel) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(channel)


def assert_cancelled(recorder: Recorder, request_id: str) -> RequestStats:
    stats = recorder.finished[request_id]
    assert stats.finish_reason == FinishReason.CANCELLED
    return stats


def test_cancel_while_queued(
    harness: ServerHarness,
    recorder: Recorder,
    aborts: Spy,
    expected: list[int],
    channel: grpc.Channel,
    stub: generation_pb2_grpc.GenerationServiceStub,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    adds = spy_on(monkeypatch, harness.engine, "add_request")
    bystanders = Bystanders(channel, "queued", expected, count=2)  # both sequence slots
    call = stub.GenerateStream(request([11] * 8, 50, "queued"))
    adds.wait("anon/queued")
    recorder.hold("bystander-queued-0", nth=2)  # by then the engine has queued it
    assert recorder.parked.wait(10)
    assert recorder.parked_at is not None and recorder.parked_at.num_waiting == 1
    call.cancel()
    aborts.wait("anon/queued")
    recorder.release()
    bystanders.check(recorder)
    harness.assert_idle()
    assert not recorder.steps_of("anon/queued")  # never scheduled
    assert assert_cancelled(recorder, "anon/queued").num_output_tokens == 0


def test_cancel_during_prefill(
    harness: ServerHarness,
    recorder: Recorder,
    aborts: Spy,
    expected: list[int],
    channel: grpc.Channel,
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    bystanders = Bystanders(channel, "prefill", expected)
    recorder.hold("anon/prefill", nth=2)  # the second of ~7 prefill chunks
    call = stub.GenerateStream(request([(13 * i) % 500 + 3 for i in range(200)], 20, "prefill"))
    assert recorder.parked.wait(10)
    assert recorder.parked_at is not None and "anon/prefill" in recorder.parked_at.prefill_req_ids
    call.cancel()
    aborts.wait("anon/prefill")
    recorder.release()
    bystanders.check(recorder)
    harness.assert_idle()
    steps = recorder.steps_of("anon/prefill")
    # The two parked chunks, plus any the core ran before the abort crossed ZMQ.
    assert len(steps) >= 2 and all("anon/prefill" in s.prefill_req_ids for s in steps)
    assert assert_cancelled(recorder, "anon/prefill").num_output_tokens == 0


def test_client_cancel_mid_decode(
    harness: ServerHarness,
    recorder: Recorder,
    aborts: Spy,
    expected: list[int],
    channel: grpc.Channel,
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    bystanders = Bystanders(channel, "decode", expected)
    recorder.hold("anon/decode", nth=3)
    call = stub.GenerateStream(request([21] * 6, 200, "decode"))
    assert next(call).HasField("start") and next(call).HasField("delta")
    assert recorder.parked.wait(10)
    call.cancel()
    aborts.wait("anon/decode")
    recorder.release()
    bystanders.check(recorder)
    harness.assert_idle()
    # The three parked steps' tokens, plus any step run before the abort crossed ZMQ.
    assert 3 <= assert_cancelled(recorder, "anon/decode").num_output_tokens < 200


def test_deadline_expiry_frees_the_request(
    harness: ServerHarness,
    recorder: Recorder,
    aborts: Spy,
    expected: list[int],
    channel: grpc.Channel,
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    bystanders = Bystanders(channel, "deadline", expected)
    recorder.hold("anon/deadline", nth=2)  # parked until the deadline has passed
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request([23] * 6, 200, "deadline"), timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert recorder.parked.is_set()
    aborts.wait("anon/deadline")
    recorder.release()
    bystanders.check(recorder)
    harness.assert_idle()
    assert_cancelled(recorder, "anon/deadline")


def test_cancel_rpc_from_another_channel(
    harness: ServerHarness,
    recorder: Recorder,
    expected: list[int],
    channel: grpc.Channel,
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    bystanders = Bystanders(channel, "rpc", expected)
    recorder.hold("anon/victim", nth=3)
    call = stub.GenerateStream(request([25] * 6, 200, "victim"))
    events = [next(call), next(call)]
    assert recorder.parked.wait(10)
    with harness.channel() as other:
        canceller = generation_pb2_grpc.GenerationServiceStub(other)
        assert canceller.Cancel(pb.CancelRequest(request_id="victim")).cancelled
        recorder.release()
        events += list(call)
        assert not canceller.Cancel(pb.CancelRequest(request_id="victim")).cancelled
        assert not canceller.Cancel(pb.CancelRequest(request_id="no-such-id")).cancelled
    assert call.code() == grpc.StatusCode.OK
    ends = [e.end for e in events if e.HasField("end")]
    assert [end.finish_reason for end in ends] == [common_pb2.FINISH_REASON_CANCELLED]
    # The abort crosses to the core process asynchronously: it takes effect at the first
    # step boundary after it arrives, so the parked step's token and at most one more.
    assert 3 <= ends[0].completion_tokens <= 4
    assert events[-1].usage.completion_tokens == ends[0].completion_tokens
    bystanders.check(recorder)
    harness.assert_idle()


def test_abrupt_disconnect(
    harness: ServerHarness,
    recorder: Recorder,
    aborts: Spy,
    expected: list[int],
    channel: grpc.Channel,
) -> None:
    bystanders = Bystanders(channel, "disconnect", expected)
    recorder.hold("anon/disconnect", nth=3)
    lost = harness.channel()
    call = generation_pb2_grpc.GenerationServiceStub(lost).GenerateStream(
        request([27] * 6, 200, "disconnect")
    )
    assert next(call).HasField("start")
    assert recorder.parked.wait(10)
    lost.close()
    aborts.wait("anon/disconnect")
    recorder.release()
    bystanders.check(recorder)
    harness.assert_idle()
    assert_cancelled(recorder, "anon/disconnect")


def open_session(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> tuple[queue.Queue[pb.SessionRequest | None], Any]:
    outbox: queue.Queue[pb.SessionRequest | None] = queue.Queue()
    call = stub.Session(iter(outbox.get, None))
    outbox.put(
        pb.SessionRequest(
            open=pb.SessionOpen(
                sampling=common_pb2.SamplingOptions(temperature=0.0),
                stopping=common_pb2.StoppingOptions(ignore_eos=True),
            )
        )
    )
    assert next(call).HasField("opened")
    return outbox, call


def start_turn(outbox: queue.Queue[pb.SessionRequest | None], call: Any, max_tokens: int) -> None:
    outbox.put(
        pb.SessionRequest(
            turn=pb.SessionTurn(
                token_ids=common_pb2.TokenIds(ids=[31] * 6),
                stopping=common_pb2.StoppingOptions(max_tokens=max_tokens),
            )
        )
    )
    assert next(call).HasField("turn_started") and next(call).HasField("delta")


def test_cancel_the_session_call_mid_turn(
    harness: ServerHarness,
    recorder: Recorder,
    aborts: Spy,
    expected: list[int],
    channel: grpc.Channel,
    stub: generation_pb2_grpc.GenerationServiceStub,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    releases = spy_on(monkeypatch, harness.engine, "release_holder")
    bystanders = Bystanders(channel, "session", expected)
    earlier = set(recorder.finished)  # the module's recorder holds earlier tests' turns
    recorder.hold("/turn-1", nth=3)
    outbox, call = open_session(stub)
    start_turn(outbox, call, 200)
    assert recorder.parked.wait(10)
    call.cancel()
    aborts.wait("/turn-1")
    releases.wait("session/")  # the session let go of its KV context
    recorder.release()
    bystanders.check(recorder)
    harness.assert_idle()
    [turn] = [
        rid
        for rid in set(recorder.finished) - earlier
        if rid.endswith("/turn-1") and 3 <= recorder.finished[rid].num_output_tokens < 200
    ]
    assert_cancelled(recorder, turn)


def test_close_mid_turn_finishes_the_turn_then_frees(
    harness: ServerHarness,
    recorder: Recorder,
    expected: list[int],
    channel: grpc.Channel,
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    bystanders = Bystanders(channel, "close", expected)
    recorder.hold("/turn-1", nth=3)
    outbox, call = open_session(stub)
    start_turn(outbox, call, 40)
    assert recorder.parked.wait(10)
    outbox.put(pb.SessionRequest(close=pb.SessionClose()))
    recorder.release()
    rest = list(call)  # ends on its own: Close ends the session once the turn is done
    assert call.code() == grpc.StatusCode.OK
    [end] = [m.turn_end for m in rest if m.HasField("turn_end")]
    assert end.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert end.usage.completion_tokens == 40
    bystanders.check(recorder)
    harness.assert_idle()


def test_cancel_rpc_is_scoped_to_the_caller(tiny_model_factory: Callable[..., Path]) -> None:
    gate = Recorder()
    harness = ServerHarness(tiny_model_factory("llama"), observer=gate, api_keys=("k1", "k2"))
    harness.start()
    try:
        with harness.channel() as ch:
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            owner, other = (("authorization", "Bearer k1"),), (("authorization", "Bearer k2"),)
            want = stub.Generate(request([33] * 6, 60), metadata=owner).choices[0].token_ids
            gate.hold("/mine", nth=3)
            call = stub.GenerateStream(request([33] * 6, 60, "mine"), metadata=owner)
            assert next(call).HasField("start")
            assert gate.parked.wait(10)
            cancel = pb.CancelRequest(request_id="mine")
            assert not stub.Cancel(cancel, metadata=other).cancelled  # not k2's request
            gate.release()
            events = list(call)
            assert delta_ids(events) == list(want)  # it kept going, undisturbed
            ends = [e.end for e in events if e.HasField("end")]
            assert [end.finish_reason for end in ends] == [common_pb2.FINISH_REASON_LENGTH]
            assert ends[0].completion_tokens == 60
            assert not stub.Cancel(cancel, metadata=owner).cancelled  # finished already
        harness.assert_idle()
    finally:
        gate.release()
        harness.stop()
