"""Undecodable request bytes on every method of every service the server registers (defects
issue, item 10): health and reflection included, not only tokenwire's own. Each call ends
INVALID_ARGUMENT with ErrorInfo MALFORMED_REQUEST and a fixed message (no ``<class ...>``, no
"Error parsing message"), and the server logs one WARNING line per call, without traceback.
The services are listed by the server itself (reflection), so a service added later is
covered too. Real server on loopback, raw bytes through a real channel; once plain and once
with tracing on (the OTel interceptor wraps every handler, the guard's included)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import details_of
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from server_harness import MODEL_NAME, ServerHarness

from tokenwire.runtime.engine.async_engine import AsyncEngine
from tokenwire.server.grpc.server import GrpcServer
from tokenwire.server.telemetry.core import Telemetry

GARBAGE = b"\xff" * 6


class TracedHarness(ServerHarness):
    """The harness's server with tracing on (spans go to a provider without exporter)."""

    async def _start(self) -> None:
        telemetry = Telemetry(provider=TracerProvider())
        self.engine = AsyncEngine(self.config, observer=telemetry, max_requests=8)
        await self.engine.start()
        self.server = GrpcServer(self.engine, MODEL_NAME, self.settings, telemetry)
        self.port = await self.server.start()
        await self.engine.warmup()
        await self.server.set_serving(True)


@pytest.fixture(scope="module", params=["plain", "traced"])
def harness(
    tiny_model_with_tokenizer: Path, request: pytest.FixtureRequest
) -> Iterator[ServerHarness]:
    kind = ServerHarness if request.param == "plain" else TracedHarness
    h = kind(tiny_model_with_tokenizer).start()
    yield h
    h.stop()


def _served_methods(channel: grpc.Channel) -> list[tuple[str, Any]]:
    """(service, method descriptor) of every method of every service reflection lists."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    (reply,) = list(stub.ServerReflectionInfo(iter([ask]), timeout=10))
    pool = descriptor_pool.Default()
    methods = []
    for service in reply.list_services_response.service:
        for method in pool.FindServiceByName(service.name).methods:
            methods.append((service.name, method))
    return methods


def _raw_call(channel: grpc.Channel, service: str, method: Any, payload: bytes) -> None:
    path = f"/{service}/{method.name}"
    if method.client_streaming:
        list(channel.stream_stream(path)(iter([payload]), timeout=10))
    elif method.server_streaming:
        list(channel.unary_stream(path)(payload, timeout=10))
    else:
        channel.unary_unary(path)(payload, timeout=10)


def test_every_service_answers_garbage_with_invalid_argument(
    harness: ServerHarness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with harness.channel() as ch:
        methods = _served_methods(ch)
        services = {service for service, _ in methods}
        assert {"grpc.health.v1.Health", "tokenwire.v1.GenerationService"} <= services
        assert any(s.startswith("grpc.reflection.") for s in services)
        kinds = {(m.client_streaming, m.server_streaming) for _, m in methods}
        assert {(False, False), (False, True), (True, True)} <= kinds
        # Every method gets garbage; health's Check also a string field of invalid UTF-8.
        check = descriptor_pool.Default().FindMethodByName("grpc.health.v1.Health.Check")
        calls = [(service, method, GARBAGE) for service, method in methods]
        calls.append(("grpc.health.v1.Health", check, b"\x0a\x02\xff\xfe"))
        for service, method, payload in calls:
            with pytest.raises(grpc.RpcError) as caught:
                _raw_call(ch, service, method, payload)
            err = caught.value
            where = f"{service}/{method.name}"
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (where, err)
            info, _ = details_of(err)
            assert info is not None and info.reason == "MALFORMED_REQUEST", where
            assert "class" not in err.details() and "parsing" not in err.details(), where
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    warnings = [r for r in caplog.records if "malformed request" in r.getMessage()]
    assert len(warnings) == len(calls)
    assert all(r.exc_info is None for r in warnings)
    harness.assert_idle()


def test_garbage_after_a_good_reflection_request(harness: ServerHarness) -> None:
    """A stream that starts well and then sends bytes that do not decode."""
    good = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    path = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    with harness.channel() as ch:
        replies = ch.stream_stream(path)(iter([good, GARBAGE]), timeout=10)
        first = next(replies)
        assert reflection_pb2.ServerReflectionResponse.FromString(first).list_services_response
        with pytest.raises(grpc.RpcError) as caught:
            list(replies)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info, _ = details_of(caught.value)
    assert info is not None and info.reason == "MALFORMED_REQUEST"


def test_guarded_health_and_reflection_still_answer(harness: ServerHarness) -> None:
    """The guard keeps each behaviour's kind: health's Watch writes with ``context.write``."""
    with harness.channel() as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        first = next(watch)
        watch.cancel()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        assert len(_served_methods(ch)) >= 10
