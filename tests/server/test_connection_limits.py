"""Connection management: the REST header and keep-alive timeouts against real sockets, the
gRPC connection options on a real server (GOAWAY after max_connection_age with calls still
finishing in the grace period, the concurrent-RPC cap, the receive size), and the client
library's retry policy retrying a real QUEUE_FULL."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import Recorder
from server_harness import ServerHarness

from tokenwire.clients.channel import DEFAULT_RETRY_POLICY, RetryPolicy
from tokenwire.clients.client import Client
from tokenwire.clients.errors import QueueFullError
from tokenwire.server.cli import build_parser
from tokenwire.server.grpc.connection import ConnectionSettings
from tokenwire.server.rest.app import RestSettings
from tokenwire.server.rest.connection import HttpConnectionSettings, http_connection_settings
from tokenwire.server.rest.server import RestServer
from tokenwire.server.rest.upstream import Upstream
from tokenwire.server.serve_args import grpc_settings
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

T = TypeVar("T")
HEADER_TIMEOUT = 0.6
KEEP_ALIVE = 1


# ---------------------------------------------------------------------------------- REST
class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def rest() -> Iterator[RestServer]:
    """The shim alone (``/health`` needs no gRPC server) with short timeouts."""
    loop = LoopThread()
    connection = HttpConnectionSettings(
        timeout_keep_alive=KEEP_ALIVE, header_timeout=HEADER_TIMEOUT
    )
    server = RestServer(RestSettings(port=0), connection)

    async def start() -> Upstream:
        upstream = Upstream.connect("127.0.0.1:9")  # never called by /health
        await server.start(upstream)
        return upstream

    upstream = loop.run(start())
    yield server
    loop.run(server.stop())
    loop.run(upstream.close())
    loop.stop()


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def _read_response(sock: socket.socket) -> bytes:
    """One complete HTTP response (status line, headers, content-length body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def test_slow_headers_are_cut_off_while_normal_requests_work(rest: RestServer) -> None:
    request = b"GET /health HTTP/1.1\r\nhost: tokenwire\r\nuser-agent: slowloris\r\n\r\n"
    sock = socket.create_connection(("127.0.0.1", rest.port), timeout=10)
    opened = time.monotonic()
    stop = threading.Event()

    def dribble() -> None:  # one byte every 50 ms: the headers would take 3.3 s
        for byte in request:
            if stop.wait(0.05):
                return
            try:
                sock.send(bytes([byte]))
            except OSError:
                return

    sender = threading.Thread(target=dribble, daemon=True)
    sender.start()
    assert httpx.get(rest.url + "/health", timeout=10).status_code == 200  # others unaffected
    answer = _read_all(sock)  # until the server closes the connection
    elapsed = time.monotonic() - opened
    stop.set()
    sender.join(5)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert HEADER_TIMEOUT <= elapsed < HEADER_TIMEOUT + 2.0


def test_headers_in_pieces_within_the_timeout_are_served(rest: RestServer) -> None:
    with socket.create_connection(("127.0.0.1", rest.port), timeout=10) as sock:
        for piece in (b"GET /hea", b"lth HTTP/1.1\r\nhost: t", b"\r\nconnection: close\r\n\r\n"):
            sock.send(piece)
        assert _read_all(sock).startswith(b"HTTP/1.1 200 ")


def test_keep_alive_connection_closes_when_idle(rest: RestServer) -> None:
    with socket.create_connection(("127.0.0.1", rest.port), timeout=10) as sock:
        sock.send(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        answered = time.monotonic()
        assert _read_all(sock) == b""
        idle = time.monotonic() - answered  # closed by the server, not by our timeout
    assert 0.9 * KEEP_ALIVE <= idle < KEEP_ALIVE + 2.0  # keep-alive, not the header timer
    # A second request's headers are timed as well (the timer re-arms per request).
    with socket.create_connection(("127.0.0.1", rest.port), timeout=10) as sock:
        sock.send(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        sock.send(b"GET /health HTTP/1.1\r\n")  # and no more
        started = time.monotonic()
        assert _read_all(sock).startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - started < HEADER_TIMEOUT + 2.0


def test_connection_settings_validate_their_flags() -> None:
    with pytest.raises(ValueError, match="--grpc-max-connection-age"):
        ConnectionSettings(max_connection_age=0)
    with pytest.raises(ValueError, match="--header-timeout"):
        HttpConnectionSettings(header_timeout=-1)
    options = dict(ConnectionSettings(max_connection_age=2.5).server_options(1 << 20))
    assert options["grpc.max_connection_age_ms"] == 2500
    assert options["grpc.max_receive_message_length"] == 1 << 20


def test_serve_flags_reach_the_settings() -> None:
    flags = ["--grpc-keepalive-time", "60", "--grpc-keepalive-timeout", "10"]
    flags += ["--grpc-max-connection-age", "30", "--grpc-max-connection-age-grace", "5"]
    flags += ["--grpc-max-concurrent-rpcs", "100", "--max-receive-message-bytes", "1024"]
    flags += ["--timeout-keep-alive", "7", "--header-timeout", "0"]
    args = build_parser().parse_args(["serve", *flags])
    assert grpc_settings(args).connection == ConnectionSettings(60, 10, 30, 5, 100, 1024, None)
    assert http_connection_settings(args) == HttpConnectionSettings(7, None)
    options = dict(grpc_settings(args).connection.server_options(16 << 20))
    assert options["grpc.max_send_message_length"] == 16 << 20  # --max-message-bytes


# ---------------------------------------------------------------------------------- gRPC
def _request(ids: list[int], max_tokens: int = 2, request_id: str = "") -> Any:
    return generation_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingOptions(temperature=0.0),
        stopping=common_pb2.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
        request_id=request_id,
    )


def test_max_connection_age_sends_goaway_and_running_calls_finish(
    tiny_model_factory: Any,
) -> None:
    connection = ConnectionSettings(
        keepalive_time=0.2, keepalive_timeout=5.0, max_connection_age=0.5,
        max_connection_age_grace=30.0,
    )  # fmt: skip
    h = ServerHarness(tiny_model_factory("llama"), in_process=True, connection=connection)
    h.start()
    try:
        with grpc.insecure_channel(h.target) as channel:
            states: list[grpc.ChannelConnectivity] = []
            went_idle = threading.Event()

            def seen(state: grpc.ChannelConnectivity) -> None:
                states.append(state)
                if state == grpc.ChannelConnectivity.IDLE and len(states) > 1:
                    went_idle.set()

            channel.subscribe(seen, try_to_connect=False)
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest())
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            assert went_idle.wait(10)  # GOAWAY: the server retired the connection
            assert grpc.ChannelConnectivity.READY in states
            h.run(h.server.set_serving(False))  # the call on the old connection goes on
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            h.run(h.server.set_serving(True))
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            assert len(stub.Generate(_request([1, 2, 3]), timeout=30).choices) == 1  # reconnects
    finally:
        h.stop()


@pytest.fixture(scope="module")
def gate() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def capped(tiny_model_factory: Any, gate: Recorder) -> Iterator[ServerHarness]:
    """One request in flight at most, 3 concurrent RPCs, requests up to 4 KiB."""
    connection = ConnectionSettings(max_concurrent_rpcs=3, max_receive_message_bytes=4096)
    h = ServerHarness(
        tiny_model_factory("llama"), observer=gate, max_requests=1, connection=connection
    )
    h.start()
    yield h
    gate.release()
    h.stop()


def test_concurrent_rpc_cap_and_receive_size(capped: ServerHarness) -> None:
    with grpc.insecure_channel(capped.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watches = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(3)]
        for watch in watches:
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as refused:
            health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for watch in watches:
            watch.cancel()
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as too_big:  # 3000 ids of 2 bytes each > 4 KiB
            stub.Generate(_request([300] * 3000), timeout=30)
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _count_attempts(
    monkeypatch: pytest.MonkeyPatch, harness: ServerHarness, on_first_refusal: Any = None
) -> list[str]:
    """Every Generate attempt that reaches the engine: its outcome, in order."""
    attempts: list[str] = []
    add_request = harness.engine.add_request

    def counted(*args: Any, **kwargs: Any) -> Any:
        try:
            stream = add_request(*args, **kwargs)
        except Exception as exc:
            attempts.append(type(exc).__name__)
            if on_first_refusal is not None and len(attempts) == 1:
                on_first_refusal()
            raise
        attempts.append("admitted")
        return stream

    monkeypatch.setattr(harness.engine, "add_request", counted)
    return attempts


def _hold_the_only_slot(capped: ServerHarness, gate: Recorder, channel: grpc.Channel) -> Any:
    gate.hold("held-0")
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    held = stub.GenerateStream(_request([5, 6, 7], max_tokens=8, request_id="held-0"))
    assert next(held).HasField("start")
    assert gate.parked.wait(10)  # held-0 stays in flight: max_requests = 1 reached
    return held


def test_retry_policy_retries_queue_full(
    capped: ServerHarness, gate: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    with grpc.insecure_channel(capped.target) as channel:
        held = _hold_the_only_slot(capped, gate, channel)
        attempts = _count_attempts(monkeypatch, capped)
        with Client(capped.target, timeout=30, retry=None) as client, pytest.raises(QueueFullError):
            client.generate([1, 2, 3], max_tokens=2)
        assert attempts == ["QueueFullError"]  # opted out: one attempt
        attempts.clear()
        with Client(capped.target, timeout=30) as client, pytest.raises(QueueFullError):
            client.generate([1, 2, 3], max_tokens=2)
        assert attempts == ["QueueFullError"] * DEFAULT_RETRY_POLICY.max_attempts
        gate.release()
        assert sum(len(e.delta.token_ids) for e in held if e.HasField("delta")) == 8
    capped.assert_idle()


def test_retry_succeeds_once_the_queue_has_room(
    capped: ServerHarness, gate: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    with grpc.insecure_channel(capped.target) as channel:
        held = _hold_the_only_slot(capped, gate, channel)
        attempts = _count_attempts(monkeypatch, capped, on_first_refusal=gate.release)
        patient = RetryPolicy(max_attempts=5, initial_backoff=0.5, max_backoff=2.0)
        with Client(capped.target, timeout=60, retry=patient) as client:
            reply = client.generate([1, 2, 3], max_tokens=2, ignore_eos=True)
        assert reply.usage.completion_tokens == 2
        assert attempts[0] == "QueueFullError" and attempts[-1] == "admitted"
        assert len(list(held)) > 0
    capped.assert_idle()
