"""Tenants of ``--api-key-file`` on a real grpc.aio server (loopback, tiny model) and its REST
shim: model lists, rate limits (RESOURCE_EXHAUSTED + RetryInfo / 429 + Retry-After), the
token budget, concurrency and session caps, per-tenant Cancel and request ids, the priority
clamp and prefix-cache isolation. Rates are tiny (one token per 100 s) so nothing depends on
timing; the one test that parks the engine does it with the core gate, never a sleep."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_helpers import Recorder, details_of
from grpc_helpers import greedy_request as request
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from rest_harness import RestHarness
from server_harness import ServerHarness

from tokenwire.runtime.engine.protocol import EngineStatsSnapshot
from tokenwire.runtime.outputs import FinishReason
from tokenwire.runtime.stats import RequestStats
from tokenwire.server.telemetry.core import Telemetry
from tokenwire.server.telemetry.tracing import TracingSettings
from tokenwire.server.tenants.config import hash_key, parse_tenants
from tokenwire.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    models_pb2,
    models_pb2_grpc,
)

pb = generation_pb2
SLOW = {"requests_per_second": 0.01}  # one request per 100 s after the burst
TENANTS: list[dict[str, Any]] = [
    {"name": "alpha", "keys": [hash_key("ka")], "limits": {"max_concurrent_requests": 1}},
    {"name": "beta", "keys": [hash_key("kb")]},
    {"name": "share1", "keys": [hash_key("ks1")], "share_prefix_cache": True},
    {"name": "share2", "keys": ["plain:ks2"], "share_prefix_cache": True},
    {"name": "narrow", "keys": [hash_key("kn")], "models": ["some-adapter"]},
    {"name": "rl", "keys": [hash_key("kr")], "limits": {**SLOW, "burst": 2}},
    {"name": "rl-rest", "keys": [hash_key("krr")], "limits": {**SLOW, "burst": 1}},
    {"name": "tok", "keys": [hash_key("kt")], "limits": {"tokens_per_minute": 6}},
    {"name": "sess", "keys": [hash_key("kss")], "limits": {"max_sessions": 1}},
    {"name": "prio", "keys": [hash_key("kp")], "max_priority": 3},
]


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module")
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def harness(tiny_model_with_tokenizer: Path, recorder: Recorder) -> Iterator[ServerHarness]:
    h = ServerHarness(tiny_model_with_tokenizer, observer=recorder, in_process=True)
    h.settings = dataclasses.replace(h.settings, tenants=parse_tenants({"tenants": TENANTS}))
    h.start()
    yield h
    recorder.release()
    h.stop()


@pytest.fixture(scope="module")
def rest(harness: ServerHarness) -> Iterator[RestHarness]:
    r = RestHarness(harness).start()
    yield r
    r.stop()


@pytest.fixture()
def stub(harness: ServerHarness) -> Iterator[generation_pb2_grpc.GenerationServiceStub]:
    with harness.channel() as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)


def refused(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def retry_delay(details: list[Any]) -> float:
    for detail in details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            return float(retry.retry_delay.ToTimedelta().total_seconds())
    raise AssertionError("no RetryInfo")


def test_keys_outside_the_file_are_refused(stub: Any) -> None:
    err = refused(lambda: stub.Generate(request([1, 2], 1), metadata=auth("nope"), timeout=30))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_model_outside_the_tenants_list_is_not_found(stub: Any, rest: RestHarness) -> None:
    """Answered like a model that does not exist: no tenant learns what others may use."""
    err = refused(lambda: stub.Generate(request([1, 2], 1), metadata=auth("kn"), timeout=30))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    info, _ = details_of(err)
    assert info is not None and info.reason == "MODEL_NOT_FOUND"
    assert err.details() == "model 'tiny' is not served here"
    reply = httpx.post(
        f"{rest.url}/v1/completions",
        json={"model": "tiny", "prompt": [1, 2], "max_tokens": 1},
        headers={"authorization": "Bearer kn"},
        timeout=30,
    )
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "model_not_found"


def test_models_are_listed_per_tenant(harness: ServerHarness, rest: RestHarness) -> None:
    """ListModels (and REST /v1/models, through it) shows a tenant only the models it may
    use; GetModelInfo of another is NOT_FOUND, as for a model that does not exist."""
    with harness.channel() as channel:
        models = models_pb2_grpc.ModelServiceStub(channel)
        listed = models.ListModels(models_pb2.ListModelsRequest(), metadata=auth("kb"))
        assert [m.name for m in listed.models] == ["tiny"]
        narrow = models.ListModels(models_pb2.ListModelsRequest(), metadata=auth("kn"))
        assert list(narrow.models) == []
        assert models.GetModelInfo(models_pb2.GetModelInfoRequest(), metadata=auth("kb")).name
        err = refused(
            lambda: models.GetModelInfo(models_pb2.GetModelInfoRequest(), metadata=auth("kn"))
        )
        assert err.code() == grpc.StatusCode.NOT_FOUND
    reply = httpx.get(f"{rest.url}/v1/models", headers={"authorization": "Bearer kn"}, timeout=30)
    assert reply.status_code == 200 and reply.json()["data"] == []


def test_requests_per_second_over_the_burst_is_resource_exhausted_with_retry_info(
    stub: Any,
) -> None:
    for _ in range(2):  # the burst
        stub.Generate(request([1, 2], 1), metadata=auth("kr"), timeout=30)
    err = refused(lambda: stub.Generate(request([1, 2], 1), metadata=auth("kr"), timeout=30))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == "tenant 'rl' exceeded requests_per_second=0.01"
    info, details = details_of(err)
    assert info is not None and info.reason == "RATE_LIMITED"
    assert dict(info.metadata) == {"tenant": "rl", "limit": "requests_per_second"}
    assert 50 < retry_delay(details) <= 100  # a token every 100 s
    # Another tenant is not affected.
    stub.Generate(request([1, 2], 1), metadata=auth("kb"), timeout=30)


def test_rest_over_the_limit_is_429_with_retry_after(rest: RestHarness) -> None:
    def post() -> httpx.Response:
        return httpx.post(
            f"{rest.url}/v1/completions",
            json={"model": "tiny", "prompt": [1, 2], "max_tokens": 1},
            headers={"authorization": "Bearer krr"},
            timeout=30,
        )

    assert post().status_code == 200
    reply = post()
    assert reply.status_code == 429
    assert 50 < int(reply.headers["retry-after"]) <= 100
    error = reply.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert error["message"] == "tenant 'rl-rest' exceeded requests_per_second=0.01"


def test_generated_tokens_are_charged_and_an_empty_bucket_refuses(stub: Any) -> None:
    reply = stub.Generate(request([1, 2, 3], 8), metadata=auth("kt"), timeout=30)
    assert reply.usage.completion_tokens == 8  # admitted with 6 in the bucket: a debt of 2
    err = refused(lambda: stub.Generate(request([1, 2], 1), metadata=auth("kt"), timeout=30))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == "tenant 'tok' exceeded tokens_per_minute=6"
    _, details = details_of(err)
    assert 2 < retry_delay(details) <= 30.5  # 0.1 tokens/s; the debt is ~2 (refilling)


def test_cancel_and_request_ids_are_scoped_per_tenant(
    harness: ServerHarness, recorder: Recorder, stub: Any
) -> None:
    recorder.hold("tenant:alpha/held", nth=2)
    held = stub.GenerateStream(request([5, 6, 7], 40, "held"), metadata=auth("ka"), timeout=60)
    try:
        assert next(held).HasField("start")
        assert recorder.parked.wait(30)  # the engine is parked inside alpha's request
        # beta cannot reach alpha's id, and may use the same id itself.
        assert not stub.Cancel(pb.CancelRequest(request_id="held"), metadata=auth("kb")).cancelled
        twin = stub.Generate.future(request([1, 2], 2, "held"), metadata=auth("kb"), timeout=60)
        # alpha's cap of one concurrent request holds while "held" runs.
        err = refused(lambda: stub.Generate(request([1, 2], 1), metadata=auth("ka"), timeout=30))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.details() == "tenant 'alpha' exceeded max_concurrent_requests=1"
        assert stub.Cancel(pb.CancelRequest(request_id="held"), metadata=auth("ka")).cancelled
    finally:
        recorder.release()
    ends = [e.end for e in held if e.HasField("end")]
    assert [end.finish_reason for end in ends] == [common_pb2.FINISH_REASON_CANCELLED]
    assert ends[0].completion_tokens < 40
    assert twin.result().usage.completion_tokens == 2
    stub.Generate(request([1, 2], 1), metadata=auth("ka"), timeout=30)  # the slot is free
    harness.assert_idle()


def test_session_cap_per_tenant(stub: Any) -> None:
    done = threading.Event()  # the sessions stay open (no half-close) until the test ends

    def messages() -> Iterator[pb.SessionRequest]:
        yield pb.SessionRequest(open=pb.SessionOpen())
        done.wait(60)

    def session(key: str) -> Any:
        return stub.Session(messages(), metadata=auth(key), timeout=60)

    calls = [session("kss")]
    try:
        assert next(calls[0]).HasField("opened")
        calls.append(session("kss"))
        err = refused(lambda: next(calls[1]))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.details() == "tenant 'sess' exceeded max_sessions=1"
        calls.append(session("kb"))
        assert next(calls[2]).HasField("opened")  # another tenant: its own count
    finally:
        done.set()
        for call in calls:
            call.cancel()


def test_priority_is_clamped_to_max_priority(
    harness: ServerHarness, stub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    add_request = harness.engine.add_request

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["priority"])
        return add_request(*args, **kwargs)

    monkeypatch.setattr(harness.engine, "add_request", spy)
    for key, wanted in (("kp", "-5"), ("kp", "7"), ("kb", "-5")):
        metadata = (*auth(key), ("x-priority", wanted))
        stub.Generate(request([1, 2], 1), metadata=metadata, timeout=30)
    assert seen == [3, 7, -5]  # lower runs first: prio may not go below 3


def test_tenants_never_share_prefix_cache_blocks_unless_allowed(stub: Any) -> None:
    prompt = list(range(100, 140))  # two full 16-token blocks

    def cached(key: str, salt: str = "") -> int:
        message = request(prompt, 1)
        message.cache_salt = salt
        reply = stub.Generate(message, metadata=auth(key), timeout=30)
        return int(reply.usage.cached_tokens)

    assert cached("kb") == 0
    assert cached("kb") >= 32  # the tenant's own blocks are reused
    assert cached("ka") == 0  # another tenant: not shared
    assert cached("ks1") == 0
    assert cached("ks2") >= 32  # both share_prefix_cache: shared
    assert cached("ks2", salt="x") == 0  # a request salt still separates
    assert cached("ka", salt="x") == 0


def test_tenant_on_the_span_and_the_request_counters() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry(TracingSettings("http://unused:4317"), provider)
    engine = SimpleNamespace(
        info=SimpleNamespace(served_model_name="m"),
        stats_snapshot=EngineStatsSnapshot,
        observer=telemetry,
    )
    telemetry.attach(engine)  # type: ignore[arg-type]
    record = telemetry.begin("r1", "tenant:alpha/r1", "generate")
    telemetry.set_tenant(record, "alpha")
    telemetry.admit(record, 1)
    t0 = time.monotonic()
    stats = RequestStats(
        "tenant:alpha/r1", t0, t0, t0 + 0.01, t0 + 0.02, 10, 3, 0, 0, FinishReason.LENGTH
    )
    telemetry.on_request_finished(stats)
    telemetry.end(record, "OK")
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "tokenwire.request"]
    assert span.attributes is not None and span.attributes["tokenwire.tenant"] == "alpha"
    samples = {
        (s.name, s.labels.get("tenant")): s.value
        for f in text_string_to_metric_families(telemetry.exposition().decode())
        for s in f.samples
    }
    assert samples[("tokenwire:request_success_total", "alpha")] == 1
    assert samples[("tokenwire:generation_tokens_total", "alpha")] == 3
