"""Every row of the docs/api.md error table through the REST shim (HTTP status, OpenAI envelope,
Retry-After), errors after the stream started (an SSE error event, then [DONE]), and client
disconnects (stream and unary) cancelling the gRPC call so the engine ends idle with every KV
block free. In-process: the engine can be parked at a chosen step (events, never sleeps)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_helpers import Recorder, spy_on
from rest_harness import RestHarness
from server_harness import ServerHarness

from tokenwire.server.grpc import convert
from tokenwire.server.rest import app as rest_app
from tokenwire.server.rest.errors import STATUS_DETAILS_KEY, from_rpc_error


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": [5, 6, 7], "temperature": 0, "ignore_eos": True, **fields}


def error_of(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error: dict[str, Any] = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


@pytest.fixture(scope="module")
def gate() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def harness_options(gate: Recorder) -> dict[str, Any]:
    return dict(observer=gate, max_requests=2)


def test_not_found(harness: ServerHarness, http_client: httpx.Client) -> None:
    error = error_of(
        http_client.post("/v1/completions", json=body(model="nope")), 404, "model_not_found"
    )
    assert error["type"] == "invalid_request_error" and "nope" in error["message"]
    error_of(http_client.get("/v1/models/nope"), 404, "model_not_found")
    harness.assert_idle()


def test_long_model_name_is_404_never_429(
    harness: ServerHarness, http_client: httpx.Client
) -> None:
    """An error quoting a huge client value used to overflow gRPC's trailer limit; grpc-core
    then failed the call as RESOURCE_EXHAUSTED, which the shim sent on as a retryable 429."""
    name = "a" * 8000
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for r in (
        http_client.get(f"/v1/models/{name}"),
        http_client.post("/v1/completions", json=body(model=name, max_tokens=2)),
        http_client.post("/v1/chat/completions", json=chat),
    ):
        error = error_of(r, 404, "model_not_found")
        assert len(error["message"]) < 400 and "a" * 257 not in r.text, error["message"][:80]
    harness.assert_idle()


def _rpc_error(code: grpc.StatusCode, status: status_pb2.Status | None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if status is not None:
        trailing.add(STATUS_DETAILS_KEY, status.SerializeToString())
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, "details")


def _status(code: int, reason: str, message: str = "boom") -> status_pb2.Status:
    status = status_pb2.Status(code=code, message=message)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain="tokenwire"))
    return status


def test_only_rate_limits_are_429() -> None:
    """RESOURCE_EXHAUSTED is a 429 only with a rate-limit reason; a rich status that disagrees
    with the call's code (grpc-core failed the call, e.g. oversized trailers) is not trusted;
    passed-through messages are bounded."""
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    for reason in ("QUEUE_FULL", "TOO_MANY_SESSIONS"):
        err = from_rpc_error(
            _rpc_error(exhausted, _status(code_pb2.RESOURCE_EXHAUSTED, reason)), {}
        )
        assert (err.status, err.code) == (429, "rate_limit_exceeded")
    overflow = _status(code_pb2.NOT_FOUND, "MODEL_NOT_FOUND", "model 'aaa...' is not served")
    for status in (overflow, None):  # the status the server sent did not come through
        err = from_rpc_error(_rpc_error(exhausted, status), {"model": "model"})
        assert (err.status, err.code, err.param) == (413, "resource_exhausted", None)
        assert err.message == "the request exceeds a server limit"
    odd = _status(code_pb2.RESOURCE_EXHAUSTED, "MODEL_NOT_FOUND")  # not a rate limit
    assert from_rpc_error(_rpc_error(exhausted, odd), {}).status == 413
    long = _status(code_pb2.NOT_FOUND, "MODEL_NOT_FOUND", "x" * 5000)
    err = from_rpc_error(_rpc_error(grpc.StatusCode.NOT_FOUND, long), {})
    assert (err.status, err.code) == (404, "model_not_found")
    assert err.message == "x" * 1024 + "\u2026"


def test_duplicate_request_id_is_409(
    harness: ServerHarness, gate: Recorder, http_client: httpx.Client
) -> None:
    gate.hold("anon/dup")
    headers = {"x-request-id": "dup"}
    with http_client.stream(
        "POST", "/v1/completions", json=body(max_tokens=20, stream=True), headers=headers
    ) as first:
        lines = first.iter_lines()
        assert next(lines).startswith("data: ")
        assert gate.parked.wait(10)
        r = http_client.post("/v1/completions", json=body(max_tokens=2), headers=headers)
        error_of(r, 409, "duplicate_request_id")
        assert r.headers["x-request-id"] == "dup"
        gate.release()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    finishes = [c["finish_reason"] for line in rest[:-1] for c in json.loads(line[6:])["choices"]]
    assert [f for f in finishes if f] == ["length"]  # the first request was left alone
    harness.assert_idle()


def test_queue_full_is_429_with_retry_after(
    harness: ServerHarness, gate: Recorder, http_client: httpx.Client
) -> None:
    gate.hold("anon/qf-", nth=2)  # three prompts, room for two: none can finish meanwhile
    r = http_client.post(
        "/v1/completions",
        json=body(prompt=[[5, 6], [7, 8], [9, 10]], max_tokens=50),
        headers={"x-request-id": "qf"},
    )
    gate.release()
    error = error_of(r, 429, "rate_limit_exceeded")
    assert error["type"] == "rate_limit_error"
    assert int(r.headers["retry-after"]) >= 1
    harness.assert_idle()  # the admitted siblings were cancelled and freed
    assert all(s.finish_reason.name == "CANCELLED" for k, s in gate.finished.items() if "qf-" in k)


def test_deadline_is_504(harness: ServerHarness, gate: Recorder) -> None:
    rest = RestHarness(harness, request_timeout=0.5).start()
    try:
        gate.hold("anon/late")
        with httpx.Client(base_url=rest.url, timeout=60) as c:
            r = c.post(
                "/v1/completions", json=body(max_tokens=100), headers={"x-request-id": "late"}
            )
        error = error_of(r, 504, "deadline_exceeded")
        assert error["type"] == "timeout_error"
        gate.release()
        harness.assert_idle()
        assert gate.finished["anon/late"].finish_reason.name == "CANCELLED"
    finally:
        gate.release()
        rest.stop()


def test_internal_errors_are_500_without_leaks(
    harness: ServerHarness, http_client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret /path/x")

    monkeypatch.setattr(convert, "tokenize_input", explode)  # fails inside the gRPC server
    r = http_client.post("/v1/completions", json=body(), headers={"x-request-id": "boom-1"})
    error = error_of(r, 500, "engine_error")
    assert "boom-1" in error["message"] and "secret" not in r.text and "/path" not in r.text
    monkeypatch.undo()
    monkeypatch.setattr(rest_app, "completion_response", explode)  # fails inside the shim
    r = http_client.post("/v1/completions", json=body(max_tokens=2))
    error = error_of(r, 500, "internal_error")
    assert error["type"] == "server_error" and "secret" not in r.text
    monkeypatch.undo()
    harness.assert_idle()


def _open(url: str, payload: dict[str, Any], request_id: str) -> socket.socket:
    """A raw HTTP/1.1 request on a socket the test can drop at any moment."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    data = json.dumps(payload).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n"
        f"x-request-id: {request_id}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_disconnect_mid_stream_cancels(
    harness: ServerHarness,
    gate: Recorder,
    rest: RestHarness,
    http_client: httpx.Client,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    aborts = spy_on(monkeypatch, harness.engine, "abort")
    gate.hold("anon/gone-stream", nth=3)
    sock = _open(rest.url, body(max_tokens=200, stream=True), "gone-stream")
    received = b""
    while b"data: " not in received:  # the first token chunk arrived: the stream is live
        received += sock.recv(65536)
    sock.close()
    aborts.wait("anon/gone-stream")  # the shim cancelled the gRPC call; the server aborted
    gate.release()
    harness.assert_idle()
    stats = gate.finished["anon/gone-stream"]
    assert stats.finish_reason.name == "CANCELLED"
    assert http_client.post("/v1/completions", json=body(max_tokens=3)).status_code == 200


def test_disconnect_while_waiting_for_unary_cancels(
    harness: ServerHarness,
    gate: Recorder,
    rest: RestHarness,
    http_client: httpx.Client,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    aborts = spy_on(monkeypatch, harness.engine, "abort")
    gate.hold("anon/gone-unary")
    sock = _open(rest.url, body(max_tokens=200), "gone-unary")
    assert gate.parked.wait(10)  # running, and the shim is waiting for the unary answer
    sock.close()
    aborts.wait("anon/gone-unary")
    gate.release()
    harness.assert_idle()
    assert gate.finished["anon/gone-unary"].finish_reason.name == "CANCELLED"
    assert http_client.post("/v1/completions", json=body(max_tokens=3)).status_code == 200


class _LogEvent(logging.Handler):
    """Sets ``seen`` once a record whose message contains ``needle`` is emitted (any thread)."""

    def __init__(self, needle: str) -> None:
        super().__init__(logging.DEBUG)
        self.needle = needle
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.seen.set()


def test_client_timing_out_on_unary_is_a_quiet_cancel(
    harness: ServerHarness,
    gate: Recorder,
    rest: RestHarness,
    http_client: httpx.Client,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that gives up on a non-streaming request (read timeout) used to get a 500 and
    an "Exception in ASGI application" traceback (InvalidStateError) in the shim's log."""
    aborts = spy_on(monkeypatch, harness.engine, "abort")
    caplog.set_level(logging.DEBUG, logger="tokenwire.rest")
    shim_log = logging.getLogger("tokenwire.rest")
    gone = _LogEvent("client disconnected before the response (request_id=hang-up)")
    shim_log.addHandler(gone)
    gate.hold("anon/hang-up")
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{rest.url}/v1/completions",
                json=body(max_tokens=40),
                headers={"x-request-id": "hang-up"},
                timeout=httpx.Timeout(30, read=1),
            )
        aborts.wait("anon/hang-up")  # the shim cancelled the gRPC call; the server aborted
        assert gone.seen.wait(10)  # the shim's handler ran to its 499
    finally:
        shim_log.removeHandler(gone)
        gate.release()
    harness.assert_idle()
    assert gate.finished["anon/hang-up"].finish_reason.name == "CANCELLED"
    assert http_client.post("/v1/completions", json=body(max_tokens=3)).status_code == 200
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [f"{r.name}: {r.getMessage()}" for r in errors]


def test_unreachable_grpc_server_is_503(harness: ServerHarness) -> None:
    with socket.socket() as probe:  # a port nobody listens on once the probe closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rest = RestHarness(harness, target=f"127.0.0.1:{port}", request_timeout=5.0).start()
    try:
        with httpx.Client(base_url=rest.url, timeout=60) as c:
            r = c.post("/v1/completions", json=body(max_tokens=2))
            error = error_of(r, 503, "unavailable")
            assert error["message"] == "the inference server is unavailable"  # no address
            error_of(c.get("/ready"), 503, "not_ready")
            assert c.get("/health").status_code == 200
    finally:
        rest.stop()


# ---------------------------------------------------------------------------- 401
def test_api_key_is_forwarded(tiny_model_factory: Callable[..., Path]) -> None:
    harness = ServerHarness(tiny_model_factory("llama"), api_keys=("k1",)).start()
    rest = RestHarness(harness).start()
    try:
        with httpx.Client(base_url=rest.url, timeout=60) as c:
            for headers in ({}, {"authorization": "Bearer wrong-zz9"}, {"authorization": "k1"}):
                r = c.post("/v1/completions", json=body(max_tokens=2), headers=headers)
                error = error_of(r, 401, "invalid_api_key")
                assert error["type"] == "authentication_error" and "zz9" not in r.text
                error_of(c.get("/v1/models", headers=headers), 401, "invalid_api_key")
            good = {"authorization": "Bearer k1"}
            assert (
                c.post("/v1/completions", json=body(max_tokens=2), headers=good).status_code == 200
            )
            assert c.get("/v1/models", headers=good).status_code == 200
            assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200
        harness.assert_idle()
    finally:
        rest.stop()
        harness.stop()


# ---------------------------------------------------------------------------- 503
def test_not_ready_is_503(tiny_model_factory: Callable[..., Path]) -> None:
    harness = ServerHarness(tiny_model_factory("llama"), warm=False).start()
    rest = RestHarness(harness).start()
    try:
        with httpx.Client(base_url=rest.url, timeout=60) as c:
            r = c.post("/v1/completions", json=body(max_tokens=2))
            error_of(r, 503, "not_ready")
            assert r.headers["retry-after"] == "1"
            error_of(c.get("/ready"), 503, "not_ready")
            assert c.get("/health").status_code == 200  # the shim itself is alive
    finally:
        rest.stop()
        harness.stop()


def test_draining_is_503_and_in_flight_finishes(tiny_model_factory: Callable[..., Path]) -> None:
    gate = Recorder()
    harness = ServerHarness(tiny_model_factory("llama"), observer=gate).start()
    rest = RestHarness(harness).start()
    try:
        with httpx.Client(base_url=rest.url, timeout=60) as c:
            gate.hold("anon/inflight")
            payload = body(max_tokens=10, stream=True)
            with c.stream(
                "POST", "/v1/completions", json=payload, headers={"x-request-id": "inflight"}
            ) as s:
                lines = s.iter_lines()
                assert next(lines).startswith("data: ")
                assert gate.parked.wait(10)
                drained = asyncio.run_coroutine_threadsafe(harness.server.drain(10), harness.loop)
                error_of(c.post("/v1/completions", json=body(max_tokens=2)), 503, "server_draining")
                gate.release()
                rest_lines = [line for line in lines if line]
            assert rest_lines[-1] == "data: [DONE]" and "error" not in "".join(rest_lines)
            drained.result(30)
        harness.assert_idle()
    finally:
        gate.release()
        rest.stop()
        harness.stop()


def test_engine_death_mid_stream_is_an_sse_error(tiny_model_factory: Callable[..., Path]) -> None:
    gate = Recorder()
    harness = ServerHarness(tiny_model_factory("llama"), observer=gate, in_process=True).start()
    rest = RestHarness(harness).start()
    try:
        with httpx.Client(base_url=rest.url, timeout=60) as c:
            gate.hold("anon/victim")
            payload = body(max_tokens=50, stream=True)
            with c.stream(
                "POST", "/v1/completions", json=payload, headers={"x-request-id": "victim"}
            ) as s:
                assert s.status_code == 200
                lines = s.iter_lines()
                assert next(lines).startswith("data: ")
                assert gate.parked.wait(10)

                def broken_step() -> Any:
                    raise RuntimeError("secret /path/to/weights")

                harness.core.step = broken_step  # type: ignore[method-assign]
                gate.release()
                tail = [line for line in lines if line]
            assert tail[-1] == "data: [DONE]"
            error = json.loads(tail[-2][6:])["error"]
            assert error["code"] == "engine_dead" and error["type"] == "service_unavailable_error"
            assert "secret" not in "".join(tail) and "/path" not in "".join(tail)
            error_of(c.post("/v1/completions", json=body(max_tokens=2)), 503, "engine_dead")
    finally:
        gate.release()
        rest.stop()
        harness.stop()
