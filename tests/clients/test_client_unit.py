"""Client library unit tests that need no server: request building (unset stays unset), error
mapping from a rich ``google.rpc.Status``, stream/session event conversion, delta assembly,
and the sync session's turn bookkeeping over a scripted in-process stream."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from tokenwire.clients import convert
from tokenwire.clients import errors as e
from tokenwire.clients import results as r
from tokenwire.clients.chat import TurnStats, chat_turn
from tokenwire.clients.sync_session import SyncSession
from tokenwire.v1 import common_pb2 as pb
from tokenwire.v1 import errors_pb2
from tokenwire.v1 import generation_pb2 as gen

# ---------------------------------------------------------------------- request building


def test_unset_options_stay_unset() -> None:
    req = convert.generate_request("Hello", None, options={})
    assert req.WhichOneof("input") == "text" and req.text == "Hello"
    for name in convert._SAMPLING:
        assert not req.sampling.HasField(name), name
    for name in convert._STOPPING:
        assert not req.stopping.HasField(name), name
    for name in convert._OUTPUT:
        assert not req.output.HasField(name), name
    assert not req.sampling.logit_bias and not req.stopping.stop and req.request_id == ""


def test_zero_values_are_sent_as_set() -> None:
    options = {"temperature": 0.0, "top_k": 0, "seed": 0, "min_tokens": 0, "logprobs": 0}
    options |= {"ignore_eos": False, "skip_special_tokens": False}
    req = convert.generate_request([1, 2, 3], None, options=options)
    assert req.WhichOneof("input") == "token_ids" and list(req.token_ids.ids) == [1, 2, 3]
    assert req.sampling.HasField("temperature") and req.sampling.temperature == 0.0
    assert req.sampling.HasField("top_k") and req.sampling.HasField("seed")
    assert req.stopping.HasField("min_tokens") and req.stopping.HasField("ignore_eos")
    assert req.output.HasField("logprobs") and req.output.logprobs == 0
    assert req.output.HasField("skip_special_tokens") and not req.output.skip_special_tokens


def test_all_knobs_land_in_their_messages() -> None:
    options: dict[str, Any] = dict(
        n=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.1, logit_bias={5: -100.0, "6": 2},
        max_tokens=32, min_tokens=4, stop="\n\n", stop_token_ids=[9, 10], ignore_eos=True,
        include_stop_str_in_output=True, logprobs=3, skip_special_tokens=True,
    )  # fmt: skip
    req = convert.generate_request(
        None, [{"role": "user", "content": "Hi"}], model="m", request_id="rid",
        cache_salt="salt", options=options,
    )  # fmt: skip
    assert req.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in req.chat.messages] == [("user", "Hi")]
    assert (req.model, req.request_id, req.cache_salt) == ("m", "rid", "salt")
    s, t, o = req.sampling, req.stopping, req.output
    assert (s.n, s.top_k, s.seed) == (2, 40, 7)
    assert s.temperature == pytest.approx(0.7) and s.repetition_penalty == pytest.approx(1.1)
    assert dict(s.logit_bias) == {5: -100.0, 6: 2.0}
    assert (t.max_tokens, t.min_tokens, list(t.stop), list(t.stop_token_ids)) == (
        32, 4, ["\n\n"], [9, 10],
    )  # fmt: skip
    assert t.ignore_eos and t.include_stop_str_in_output
    assert o.logprobs == 3 and o.skip_special_tokens


def test_input_must_be_exactly_one() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        convert.generate_request(None, None, options={})
    with pytest.raises(ValueError, match="exactly one"):
        convert.generate_request("a", [{"role": "user", "content": "b"}], options={})
    with pytest.raises(ValueError, match="exactly one"):
        convert.session_turn("a", "b", None, {})
    with pytest.raises(TypeError, match="temprature"):
        convert.generate_request("a", None, options={"temprature": 1.0})


def test_session_messages() -> None:
    opening = convert.session_open("m", "Be brief.", None, {"max_tokens": 8})
    assert opening.open.system_prompt == "Be brief." and opening.open.stopping.max_tokens == 8
    assert not opening.open.sampling.HasField("temperature")
    turn = convert.session_turn("Hi", None, None, {"temperature": 0.0})
    assert turn.turn.WhichOneof("input") == "user_message"
    assert turn.turn.sampling.HasField("temperature")
    assert convert.session_turn(None, None, [4, 5], {}).turn.WhichOneof("input") == "token_ids"


def test_call_metadata() -> None:
    assert convert.call_metadata(None) == ()
    assert convert.call_metadata("k", "rid", 3) == (
        ("authorization", "Bearer k"), ("x-request-id", "rid"), ("x-priority", "3"),
    )  # fmt: skip


# --------------------------------------------------------------------------------- errors


class FakeRpcError(grpc.RpcError):
    """What a failed call looks like to grpc_status: code, details, trailing metadata."""

    def __init__(
        self, code: grpc.StatusCode, message: str, status: status_pb2.Status | None = None,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> None:  # fmt: skip
        self._code, self._message, self._status, self._extra = code, message, status, extra

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:
        rich = () if self._status is None else (
            ("grpc-status-details-bin", self._status.SerializeToString()),
        )  # fmt: skip
        return (*rich, *self._extra)


def rich_error(
    code: grpc.StatusCode, reason: str | None, message: str = "boom", **metadata: str
) -> FakeRpcError:
    status = status_pb2.Status(code=code.value[0], message=message)
    if reason is not None:
        info = error_details_pb2.ErrorInfo(reason=reason, domain="tokenwire", metadata=metadata)
        status.details.add().Pack(info)
    if reason == "QUEUE_FULL":
        retry = error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(seconds=2, nanos=5 * 10**8)
        )
        status.details.add().Pack(retry)
    return FakeRpcError(code, message, status)


C = grpc.StatusCode
TABLE = [
    (C.INVALID_ARGUMENT, "INVALID_PARAMETER", e.InvalidArgumentError),
    (C.INVALID_ARGUMENT, "CONTEXT_LENGTH_EXCEEDED", e.ContextLengthExceededError),
    (C.UNAUTHENTICATED, "API_KEY_INVALID", e.AuthenticationError),
    (C.NOT_FOUND, "MODEL_NOT_FOUND", e.ModelNotFoundError),
    (C.ALREADY_EXISTS, "DUPLICATE_REQUEST_ID", e.DuplicateRequestError),
    (C.RESOURCE_EXHAUSTED, "QUEUE_FULL", e.QueueFullError),
    (C.RESOURCE_EXHAUSTED, "TOO_MANY_SESSIONS", e.QueueFullError),
    (C.DEADLINE_EXCEEDED, None, e.DeadlineExceededError),
    (C.UNAVAILABLE, "SERVER_DRAINING", e.UnavailableError),
    (C.UNAVAILABLE, "NOT_READY", e.UnavailableError),
    (C.UNAVAILABLE, "ENGINE_DEAD", e.UnavailableError),
    (C.INTERNAL, "ENGINE_ERROR", e.InternalError),
    (C.CANCELLED, None, e.CancelledError),
]


@pytest.mark.parametrize(("code", "reason", "cls"), TABLE, ids=[str(t[1] or t[0]) for t in TABLE])
def test_error_table(code: grpc.StatusCode, reason: str | None, cls: type) -> None:
    err = e.from_rpc_error(rich_error(code, reason), request_id="rid")
    assert type(err) is cls and isinstance(err, e.TokenwireError)
    assert (err.code, err.reason, err.message, err.request_id) == (code, reason, "boom", "rid")
    assert err.retry_after == (2.5 if reason == "QUEUE_FULL" else None)
    expected = errors_pb2.ErrorReason.Value(f"ERROR_REASON_{reason or 'UNSPECIFIED'}")
    assert err.error_reason == expected


def test_unknown_reason_follows_the_code() -> None:
    """A reason this client does not know (a newer server's) keeps its string, maps to
    ERROR_REASON_UNSPECIFIED, and the class follows the status code."""
    err = e.from_rpc_error(rich_error(C.UNAVAILABLE, "SOMETHING_NEW"))
    assert type(err) is e.UnavailableError and err.reason == "SOMETHING_NEW"
    assert err.error_reason == errors_pb2.ERROR_REASON_UNSPECIFIED


def test_invalid_parameter_names_the_param() -> None:
    fake = rich_error(C.INVALID_ARGUMENT, "INVALID_PARAMETER", "top_p must be in (0, 1]",
                      param="top_p", request_id="srv-1")  # fmt: skip
    err = e.from_rpc_error(fake, request_id="mine")
    assert isinstance(err, e.InvalidArgumentError) and err.param == "top_p"
    assert err.request_id == "srv-1" and err.metadata["param"] == "top_p"
    assert str(err) == "INVALID_PARAMETER: top_p must be in (0, 1]"


def test_missing_or_inconsistent_details_fall_back_to_the_code() -> None:
    plain = e.from_rpc_error(FakeRpcError(C.UNAVAILABLE, "connection refused"))
    assert type(plain) is e.UnavailableError and plain.reason is None
    assert plain.message == "connection refused"
    mismatched = rich_error(C.INTERNAL, "ENGINE_ERROR")
    mismatched._code = C.UNKNOWN  # status proto code disagrees with the call's code
    err = e.from_rpc_error(mismatched)
    assert type(err) is e.TokenwireError and err.code == C.UNKNOWN and err.reason is None
    echoed = FakeRpcError(C.INTERNAL, "x", extra=(("x-request-id", "echo"),))
    assert e.from_rpc_error(echoed, request_id="mine").request_id == "echo"
    exhausted = e.from_rpc_error(FakeRpcError(C.RESOURCE_EXHAUSTED, "message too large"))
    assert type(exhausted) is e.TokenwireError  # no QUEUE_FULL reason: not a queue error


def test_in_band_status() -> None:
    status = rich_error(C.INVALID_ARGUMENT, "CONTEXT_LENGTH_EXCEEDED", "too long")._status
    assert status is not None
    err = e.from_status(status)
    assert isinstance(err, e.ContextLengthExceededError) and err.message == "too long"
    other = any_pb2.Any()
    other.Pack(error_details_pb2.DebugInfo(detail="ignored"))
    status.details.append(other)
    assert e.from_status(status).reason == "CONTEXT_LENGTH_EXCEEDED"


# ------------------------------------------------------------------------ events, assembly


def logprob(token_id: int, token: str) -> pb.PositionLogprobs:
    chosen = pb.TokenLogprob(token_id=token_id, token=token, logprob=-0.5, rank=1)
    alt = pb.TokenLogprob(token_id=99, token="z", logprob=-2.0, rank=2)
    return pb.PositionLogprobs(chosen=chosen, top=[chosen, alt])


def stream_messages() -> list[gen.GenerateStreamResponse]:
    m = gen.GenerateStreamResponse
    return [
        m(start=gen.StreamStart(request_id="rid", model="m", prompt_tokens=5, cached_tokens=0)),
        m(delta=gen.TokenDelta(index=0, text="Hel", token_ids=[1], logprobs=[logprob(1, "Hel")])),
        m(delta=gen.TokenDelta(index=1, text="Bye", token_ids=[7])),
        m(delta=gen.TokenDelta(index=0, text="lo", token_ids=[2], logprobs=[logprob(2, "lo")])),
        m(end=gen.ChoiceEnd(index=1, finish_reason=pb.FINISH_REASON_STOP_TOKEN, stop_token_id=0,
                            completion_tokens=1)),
        m(end=gen.ChoiceEnd(index=0, finish_reason=pb.FINISH_REASON_STOP_SEQUENCE,
                            stop_sequence="!", completion_tokens=2)),
        m(usage=pb.Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=0)),
    ]  # fmt: skip


def test_stream_events_and_assembly_match_unary() -> None:
    events = [convert.stream_event(msg) for msg in stream_messages()]
    assert all(ev is not None for ev in events)
    end1 = events[4]
    assert isinstance(end1, r.ChoiceEnd) and end1.finish_reason == "stop_token"
    assert end1.stop_token_id == 0 and end1.stop_sequence is None  # optional 0 is still set
    assembled = convert.assemble(ev for ev in events if ev is not None)
    unary = convert.completion(gen.GenerateResponse(
        request_id="rid", model="m", usage=pb.Usage(prompt_tokens=5, completion_tokens=3),
        choices=[
            gen.Choice(index=0, text="Hello", token_ids=[1, 2],
                       logprobs=[logprob(1, "Hel"), logprob(2, "lo")],
                       finish_reason=pb.FINISH_REASON_STOP_SEQUENCE, stop_sequence="!"),
            gen.Choice(index=1, text="Bye", token_ids=[7],
                       finish_reason=pb.FINISH_REASON_STOP_TOKEN, stop_token_id=0),
        ],
    ))  # fmt: skip
    assert assembled == unary
    assert assembled.text == "Hello" and assembled.choices[0].finish_reason == "stop_sequence"
    first = assembled.choices[0].logprobs[0]
    assert (first.token, first.logprob, [t.token_id for t in first.top]) == ("Hel", -0.5, [1, 99])


def test_finish_reason_names() -> None:
    assert convert.finish_reason(pb.FINISH_REASON_EOS) == "eos"
    assert convert.finish_reason(pb.FINISH_REASON_CONTEXT_LENGTH) == "context_length"
    assert convert.finish_reason(pb.FINISH_REASON_UNSPECIFIED) == "unspecified"
    none_ = convert.completion(gen.GenerateResponse(choices=[gen.Choice(text="x")])).choices[0]
    assert none_.stop_sequence is None and none_.stop_token_id is None


# ---------------------------------------------------------------- sync session bookkeeping


def session_msg(**kwargs: Any) -> gen.SessionResponse:
    return gen.SessionResponse(**kwargs)


def turn_messages(turn: int, request: gen.SessionTurn, n: int) -> Iterator[gen.SessionResponse]:
    if request.user_message == "fail":
        bad = rich_error(C.INVALID_ARGUMENT, "INVALID_PARAMETER", "bad", param="top_p")._status
        yield session_msg(turn_end=gen.TurnEnd(turn=turn, error=bad))
        return
    yield session_msg(
        turn_started=gen.TurnStarted(
            turn=turn, request_id=f"t{turn}", prompt_tokens=10 * turn, cached_tokens=8
        )
    )
    for i in range(n):
        for word in ("a", "b", "c"):
            delta = gen.TokenDelta(index=i, text=word, token_ids=[ord(word)])
            yield session_msg(delta=gen.TurnDelta(turn=turn, delta=delta))
    for i in range(n):
        yield session_msg(turn_end=gen.TurnEnd(
            turn=turn, index=i, finish_reason=pb.FINISH_REASON_EOS,
            usage=pb.Usage(prompt_tokens=10 * turn, completion_tokens=3 * n, cached_tokens=8),
        ))  # fmt: skip


class ScriptedSession:
    """Stands in for the Session stub method: answers each request read from the client."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, requests: Iterator[gen.SessionRequest], **_: Any) -> Iterator[Any]:
        turn = 0
        for request in requests:
            kind = request.WhichOneof("message")
            self.seen.append(kind)
            if kind == "open":
                yield session_msg(opened=gen.SessionOpened(session_id="s1", model="m"))
            elif kind == "turn":
                turn += 1
                n = request.turn.sampling.n if request.turn.sampling.HasField("n") else 1
                yield from turn_messages(turn, request.turn, n)
            elif kind == "close":
                return


def open_session(script: ScriptedSession, n: int = 1) -> SyncSession:
    opening = convert.session_open("m", None, None, {})
    return SyncSession(script, opening, (), n, None)


def test_session_turns_errors_and_close() -> None:
    script = ScriptedSession()
    session = open_session(script)
    assert session.session_id == "s1" and session.info.model == "m"
    events = list(session.send("hi"))
    assert isinstance(events[0], r.TurnStart) and events[0].cached_tokens == 8
    assert "".join(ev.text for ev in events if isinstance(ev, r.TextDelta)) == "abc"
    assert isinstance(events[-1], r.TurnEnd) and events[-1].finish_reason == "eos"
    with pytest.raises(e.InvalidArgumentError) as info:
        list(session.send("fail"))
    assert info.value.param == "top_p"
    two = list(session.send("again", n=2))  # one TurnEnd per choice
    assert [ev.index for ev in two if isinstance(ev, r.TurnEnd)] == [0, 1]
    session.close()
    assert session.closed and script.seen == ["open", "turn", "turn", "turn", "close"]


def test_breaking_out_of_a_turn_cancels_and_drains_it() -> None:
    script = ScriptedSession()
    with open_session(script) as session:
        for event in session.send("hi"):
            if isinstance(event, r.TextDelta):
                break  # the generator's finally sends CancelTurn and drains the turn
        events = list(session.send("next"))
        assert isinstance(events[0], r.TurnStart) and events[0].turn == 2
    assert script.seen == ["open", "turn", "cancel_turn", "turn", "close"]


def test_chat_turn_prints_tokens_and_stats() -> None:
    out = io.StringIO()
    with open_session(ScriptedSession()) as session:
        stats = chat_turn(session, "hi", out)
    assert out.getvalue() == "abc\n"
    assert (stats.completion_tokens, stats.prompt_tokens, stats.cached_tokens) == (3, 10, 8)
    assert stats.finish_reason == "eos" and stats.ttft_s is not None
    line = TurnStats(0.1234, 20, 25.0, 98, 64, "eos").render()
    assert line == "TTFT 123 ms · 25.0 tok/s · 20 tokens · cache 64/98 prompt tokens · eos"
