"""Every row of the docs/api.md error table: gRPC code + ``ErrorInfo.reason`` (and metadata),
every parameter check naming its field, and API-key auth on every RPC."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format, message_factory
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import Recorder, delta_ids, details_of, greedy_request, spy_on
from server_harness import ServerHarness

from tokenwire.server.grpc import convert
from tokenwire.v1 import common_pb2, generation_pb2_grpc, models_pb2, models_pb2_grpc
from tokenwire.v1 import generation_pb2 as pb

Code = grpc.StatusCode


def request(
    ids: list[int] | None = None, max_tokens: int = 4, request_id: str = ""
) -> pb.GenerateRequest:
    return greedy_request([5, 6, 7] if ids is None else ids, max_tokens, request_id)


def failure(
    call: Callable[[], Any],
) -> tuple[grpc.RpcError, error_details_pb2.ErrorInfo | None, list[Any]]:
    """Run a call that must fail: (error, its ErrorInfo, all status details)."""
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        if hasattr(result, "__next__"):
            list(result)  # a stream: errors surface while reading
    return (caught.value, *details_of(caught.value))


def expect(
    call: Callable[[], Any], code: grpc.StatusCode, reason: str
) -> tuple[grpc.RpcError, error_details_pb2.ErrorInfo, list[Any]]:
    err, info, details = failure(call)
    assert err.code() == code, err.details()
    assert info is not None and info.reason == reason
    return err, info, details


@pytest.fixture(scope="module")
def gate() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def harness_options(gate: Recorder) -> dict[str, Any]:
    return dict(observer=gate, max_requests=2)


# ---------------------------------------------------------------------------- INVALID_ARGUMENT
INVALID = [  # (the field ErrorInfo must name, a patch over a valid greedy request)
    ("temperature", {"sampling": {"temperature": -1}}),
    ("temperature", {"sampling": {"temperature": "NaN"}}),
    ("top_p", {"sampling": {"top_p": 0}}),
    ("top_p", {"sampling": {"top_p": 1.5}}),
    ("top_k", {"sampling": {"top_k": -2}}),
    ("min_p", {"sampling": {"min_p": 1.5}}),
    ("n", {"sampling": {"n": 0}}),
    ("n", {"sampling": {"n": 17}}),  # over the server limit (16)
    ("presence_penalty", {"sampling": {"presence_penalty": 2.5}}),
    ("frequency_penalty", {"sampling": {"frequency_penalty": -2.5}}),
    ("repetition_penalty", {"sampling": {"repetition_penalty": 0}}),
    ("seed", {"sampling": {"seed": 2**64 - 1}}),
    ("logit_bias", {"sampling": {"logit_bias": {"5": 150}}}),
    ("logit_bias", {"sampling": {"logit_bias": {"512": 1}}}),  # outside the vocabulary
    ("max_tokens", {"stopping": {"max_tokens": 0}}),  # explicitly set 0
    ("min_tokens", {"stopping": {"min_tokens": 5}}),  # > max_tokens (4)
    ("stop", {"stopping": {"stop": [f"s{i}" for i in range(17)]}}),
    ("stop", {"stopping": {"stop": [""]}}),
    ("stop", {"stopping": {"stop": ["x" * 257]}}),
    ("stop_token_ids", {"stopping": {"stop_token_ids": [512]}}),
    ("logprobs", {"output": {"logprobs": 21}}),
    ("input", {"token_ids": None}),  # no input at all
    ("token_ids", {"token_ids": {"ids": []}}),
    ("token_ids", {"token_ids": {"ids": [5, 512]}}),
    ("request_id", {"request_id": "r" * 129}),
    ("request_id", {"request_id": "bad\nid"}),
]


@pytest.mark.parametrize(
    ("param", "patch"), INVALID, ids=[f"{p}-{i}" for i, (p, _) in enumerate(INVALID)]
)
def test_invalid_parameter_names_the_field(
    gen: generation_pb2_grpc.GenerationServiceStub, param: str, patch: dict[str, Any]
) -> None:
    req = request()
    if "token_ids" in patch:
        req.ClearField("token_ids")
    json_format.ParseDict({k: v for k, v in patch.items() if v is not None}, req)
    for method in (gen.Generate, gen.GenerateStream):
        err, info, _ = expect(lambda m=method: m(req), Code.INVALID_ARGUMENT, "INVALID_PARAMETER")
        assert info.metadata["param"] == param
        assert param in err.details()


def test_bad_priority_header(gen: generation_pb2_grpc.GenerationServiceStub) -> None:
    _, info, _ = expect(
        lambda: gen.Generate(request(), metadata=(("x-priority", "high"),)),
        Code.INVALID_ARGUMENT,
        "INVALID_PARAMETER",
    )
    assert info.metadata["param"] == "x-priority"


def test_context_length_exceeded(gen: generation_pb2_grpc.GenerationServiceStub) -> None:
    _, info, _ = expect(
        lambda: gen.Generate(request([5] * 250, max_tokens=7)),
        Code.INVALID_ARGUMENT,
        "CONTEXT_LENGTH_EXCEEDED",
    )
    assert info.metadata["param"] == "max_tokens"
    _, info, _ = expect(
        lambda: gen.Generate(request([5] * 256)), Code.INVALID_ARGUMENT, "CONTEXT_LENGTH_EXCEEDED"
    )
    assert info.metadata["param"] == "token_ids"
    assert gen.Generate(request([5] * 250, max_tokens=6)).usage.completion_tokens == 6


# ---------------------------------------------------------------------------- NOT_FOUND
def test_unknown_model(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub
) -> None:
    req = request()
    req.model = "no-such-model"
    _, info, _ = expect(lambda: gen.Generate(req), Code.NOT_FOUND, "MODEL_NOT_FOUND")
    assert info.metadata["model"] == "no-such-model"
    with harness.channel() as ch:
        models = models_pb2_grpc.ModelServiceStub(ch)
        expect(
            lambda: models.GetModelInfo(models_pb2.GetModelInfoRequest(model="x")),
            Code.NOT_FOUND,
            "MODEL_NOT_FOUND",
        )
        expect(
            lambda: models.Tokenize(models_pb2.TokenizeRequest(model="x", text="a")),
            Code.NOT_FOUND,
            "MODEL_NOT_FOUND",
        )
    opening = pb.SessionRequest(open=pb.SessionOpen(model="x"))
    expect(lambda: gen.Session(iter([opening])), Code.NOT_FOUND, "MODEL_NOT_FOUND")
    gen.Generate(request(), timeout=10)  # the empty name means the served model
    harness.assert_idle()


# ---------------------------------------------------------------------------- in-flight limits
def test_duplicate_request_id_leaves_the_first_alone(
    harness: ServerHarness, gate: Recorder, gen: generation_pb2_grpc.GenerationServiceStub
) -> None:
    want = list(gen.Generate(request(max_tokens=30)).choices[0].token_ids)
    gate.hold("anon/dup")
    first = gen.GenerateStream(request(max_tokens=30, request_id="dup"))
    assert next(first).HasField("start")
    assert gate.parked.wait(10)  # "dup" is in flight until released
    for method in (gen.Generate, gen.GenerateStream):
        expect(
            lambda m=method: m(request(request_id="dup")),
            Code.ALREADY_EXISTS,
            "DUPLICATE_REQUEST_ID",
        )
    gate.release()
    events = list(first)
    assert delta_ids(events) == want
    assert [e.end.finish_reason for e in events if e.HasField("end")] == [
        common_pb2.FINISH_REASON_LENGTH
    ]
    harness.assert_idle()


def test_queue_full_carries_retry_info(
    harness: ServerHarness,
    gate: Recorder,
    gen: generation_pb2_grpc.GenerationServiceStub,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate.hold("anon/held-0")
    held = [gen.GenerateStream(request(max_tokens=8, request_id="held-0"))]
    assert next(held[0]).HasField("start")
    assert gate.parked.wait(10)  # held-0 stays in flight
    added = spy_on(monkeypatch, harness.engine, "add_request")
    held.append(gen.GenerateStream(request(max_tokens=8, request_id="held-1")))
    added.wait("anon/held-1")  # max_requests = 2 reached
    _, _, details = expect(lambda: gen.Generate(request()), Code.RESOURCE_EXHAUSTED, "QUEUE_FULL")
    retry = error_details_pb2.RetryInfo()
    assert any(d.Unpack(retry) for d in details if d.Is(retry.DESCRIPTOR))
    assert retry.retry_delay.ToNanoseconds() > 0
    gate.release()
    for call in held:
        assert len(delta_ids(call)) == 8
    gen.Generate(request())  # room again
    harness.assert_idle()


def test_deadline_exceeded(
    harness: ServerHarness,
    gate: Recorder,
    gen: generation_pb2_grpc.GenerationServiceStub,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    aborts = spy_on(monkeypatch, harness.engine, "abort")
    gate.hold("anon/late")
    err, info, _ = failure(
        lambda: gen.Generate(request(max_tokens=200, request_id="late"), timeout=0.5)
    )
    assert err.code() == Code.DEADLINE_EXCEEDED and info is None
    aborts.wait("anon/late")  # the server gave up on the call while the engine was parked
    gate.release()
    harness.assert_idle()  # the expired call's request was aborted and freed
    assert gate.finished["anon/late"].finish_reason.name == "CANCELLED"


# ---------------------------------------------------------------------------- INTERNAL
def test_unexpected_exception_is_internal_without_leaks(
    harness: ServerHarness,
    gen: generation_pb2_grpc.GenerationServiceStub,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def explode(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret /path/x")

    monkeypatch.setattr(convert, "tokenize_input", explode)
    for method in (gen.Generate, gen.GenerateStream):
        err, _, _ = expect(
            lambda m=method: m(request(request_id="boom-1")), Code.INTERNAL, "ENGINE_ERROR"
        )
        assert "boom-1" in err.details()
        assert "secret" not in err.details() and "/path" not in err.details()
    monkeypatch.undo()
    harness.assert_idle()


def test_engine_fault_on_one_request_is_internal(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request the core fails to add (an engine fault, injected on the in-process core)
    ends INTERNAL without leaks; the engine serves the next request."""

    def explode(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret /path/x")

    harness = ServerHarness(tiny_model_factory("llama"), in_process=True).start()
    try:
        with harness.channel() as ch:
            gen = generation_pb2_grpc.GenerationServiceStub(ch)
            monkeypatch.setattr(harness.core, "add_request", explode)  # fails in the core
            err, _, _ = expect(
                lambda: gen.Generate(request(request_id="boom-2")), Code.INTERNAL, "ENGINE_ERROR"
            )
            assert "boom-2" in err.details() and "secret" not in err.details()
            monkeypatch.undo()
            harness.assert_idle()
            assert gen.Generate(request()).usage.completion_tokens == 4  # the engine lives on
    finally:
        harness.stop()


# ---------------------------------------------------------------------------- UNAVAILABLE
def test_draining_refuses_new_calls(tiny_model_factory: Callable[..., Path]) -> None:
    gate = Recorder()
    harness = ServerHarness(tiny_model_factory("llama"), observer=gate).start()
    try:
        with harness.channel() as ch:
            gen = generation_pb2_grpc.GenerationServiceStub(ch)
            outbox: queue.Queue[pb.SessionRequest | None] = queue.Queue()
            outbox.put(pb.SessionRequest(open=pb.SessionOpen()))
            session = gen.Session(iter(outbox.get, None))
            gate.hold("anon/inflight")
            inflight = gen.GenerateStream(request(max_tokens=10, request_id="inflight"))
            assert next(inflight).HasField("start")
            assert gate.parked.wait(10)
            drained = asyncio.run_coroutine_threadsafe(harness.server.drain(10), harness.loop)
            first = next(session)
            notice = next(session)  # sent once draining has begun
            assert first.HasField("opened")
            assert notice.notice.kind == pb.NOTICE_KIND_DRAINING
            expect(lambda: gen.Generate(request()), Code.UNAVAILABLE, "SERVER_DRAINING")
            health = health_pb2_grpc.HealthStub(ch)
            status = health.Check(health_pb2.HealthCheckRequest(service="")).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            gate.release()
            # In-flight work is finished, not cut off.
            assert len(delta_ids(inflight)) == 10
            drained.result(30)
            outbox.put(None)
            list(session)
        harness.assert_idle()
    finally:
        gate.release()
        harness.stop()


def test_engine_death_is_unavailable(tiny_model_factory: Callable[..., Path]) -> None:
    """The core's step raising (injected on the in-process core); a killed core process is
    tested in test_engine_process.py."""
    gate = Recorder()
    harness = ServerHarness(tiny_model_factory("llama"), observer=gate, in_process=True).start()
    try:
        with harness.channel() as ch:
            gen = generation_pb2_grpc.GenerationServiceStub(ch)
            gate.hold("anon/victim")
            victim = gen.GenerateStream(request(max_tokens=50, request_id="victim"))
            assert next(victim).HasField("start")
            assert gate.parked.wait(10)

            def broken_step() -> Any:
                raise RuntimeError("secret /path/to/weights")

            harness.core.step = broken_step  # type: ignore[method-assign]
            gate.release()
            for call in (lambda: victim, lambda: gen.Generate(request())):
                err, _, _ = expect(call, Code.UNAVAILABLE, "ENGINE_DEAD")
                assert "secret" not in err.details() and "/path" not in err.details()
            # A dead engine leaves load balancing: health turns NOT_SERVING (watched, no poll).
            watch = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=30
            )
            assert any(r.status == health_pb2.HealthCheckResponse.NOT_SERVING for r in watch)
            watch.cancel()
    finally:
        gate.release()
        harness.stop()


def test_not_ready_before_warm_up(tiny_model_factory: Callable[..., Path]) -> None:
    harness = ServerHarness(tiny_model_factory("llama"), warm=False).start()
    try:
        with harness.channel() as ch:
            gen = generation_pb2_grpc.GenerationServiceStub(ch)
            expect(lambda: gen.Generate(request()), Code.UNAVAILABLE, "NOT_READY")
            health = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        harness.assert_idle()
    finally:
        harness.stop()


# ---------------------------------------------------------------------------- UNAUTHENTICATED
def _auth_request(method: Any) -> Any:
    message = message_factory.GetMessageClass(method.input_type)()
    if method.name in ("Generate", "GenerateStream"):
        message.CopyFrom(request())
    if method.name == "Session":
        return iter([pb.SessionRequest(open=pb.SessionOpen())])
    return message


METHODS = [
    (svc, m)
    for svc, module in (("GenerationService", pb), ("ModelService", models_pb2))
    for m in module.DESCRIPTOR.services_by_name[svc].methods
]


@pytest.fixture(scope="module")
def secured(tiny_model_factory: Callable[..., Path]) -> Iterator[ServerHarness]:
    h = ServerHarness(tiny_model_factory("llama"), api_keys=("k1", "k2")).start()
    yield h
    h.stop()


@pytest.mark.parametrize("method", [m for _, m in METHODS], ids=[m.name for _, m in METHODS])
def test_every_rpc_needs_a_valid_key(
    secured: ServerHarness, method: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    added = spy_on(monkeypatch, secured.engine, "add_request")
    with secured.channel() as ch:
        stubs = {
            "GenerationService": generation_pb2_grpc.GenerationServiceStub(ch),
            "ModelService": models_pb2_grpc.ModelServiceStub(ch),
        }
        rpc = getattr(stubs[method.containing_service.name], method.name)

        def call(*metadata: tuple[str, str]) -> Any:
            result = rpc(_auth_request(method), metadata=metadata)
            return list(result) if method.server_streaming else result

        for bad in (
            (),
            (("authorization", "Bearer wrong-key-zz9"),),
            (("authorization", "k1"),),
            (("authorization", "Bearer "),),
        ):
            err, _, _ = expect(lambda b=bad: call(*b), Code.UNAUTHENTICATED, "API_KEY_INVALID")
            assert "zz9" not in err.details() and "wrong-key" not in str(err.trailing_metadata())
        assert added.calls == []  # refused before any work
        for key in ("k1", "k2"):
            try:
                call(("authorization", f"Bearer {key}"))
            except grpc.RpcError as err:  # e.g. Tokenize on the tokenizer-less tiny model
                assert err.code() != Code.UNAUTHENTICATED
    secured.assert_idle()


def test_health_needs_no_key(secured: ServerHarness) -> None:
    with secured.channel() as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
