"""The engine core in a process of its own, seen from outside: ``tokenwire serve`` as a real
subprocess tree (a new session, so its process group can be listed with ``ps``).

- the core killed mid-stream: every in-flight stream ends UNAVAILABLE / ENGINE_DEAD within
  5 s, health turns NOT_SERVING, ``/ready`` 503, the server exits non-zero, nothing is left;
- the front killed: the core exits with it (no orphans);
- ``/metrics`` needs the API key on the REST port, and ``--metrics-port`` moves it off.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import details_of, greedy_request
from rest_harness import RestHarness
from serve_process import Served, serve, wait_gone
from server_harness import ServerHarness

from tokenwire.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow


@pytest.fixture()
def model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


def test_core_killed_mid_stream(model: Path) -> None:
    served = serve(model, "--shutdown-timeout", "30")
    try:
        core = psutil.Process(served.core_pid)
        # The front, the core and (spawn's) multiprocessing resource tracker.
        assert core.ppid() == served.proc.pid
        assert {served.proc.pid, core.pid} <= set(served.group())
        with grpc.insecure_channel(served.target) as ch:
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            streams = [
                stub.GenerateStream(greedy_request([5, 6, 7], 200, request_id=f"s{i}"))
                for i in range(3)
            ]
            for call in streams:
                assert next(call).HasField("start")
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            core.suspend()  # SIGSTOP: every stream is surely still in flight ...
            killed_at = time.monotonic()
            core.kill()  # ... when the core dies
            for call in streams:
                with pytest.raises(grpc.RpcError) as caught:
                    for _ in call:
                        pass
                info, _ = details_of(caught.value)
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                assert info is not None and info.reason == "ENGINE_DEAD"
            assert time.monotonic() - killed_at < 5.0
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert served.proc.wait(timeout=60) != 0  # a supervisor restarts it
        assert wait_gone(served.group(), 5.0) == []
        assert any("ENGINE_DEAD" in line or "engine core died" in line for line in served.lines)
    finally:
        if served.proc.poll() is None:
            os.killpg(served.proc.pid, signal.SIGKILL)


def test_killed_core_seen_through_the_harness(tiny_model_factory: Callable[..., Path]) -> None:
    """The same fault on a server that stays up (the harness never exits): a stream over
    REST ends with an in-band error, health NOT_SERVING, ``/ready`` 503, and new requests
    get UNAVAILABLE / 503 naming the dead engine."""
    harness = ServerHarness(tiny_model_factory("llama")).start()
    rest = RestHarness(harness).start()
    try:
        assert harness.core_pid != os.getpid()
        with httpx.Client(base_url=rest.url, timeout=60) as http:
            assert http.get("/ready").status_code == 200
            payload = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "stream": True}
            with http.stream("POST", "/v1/completions", json=payload) as reply:
                lines = reply.iter_lines()
                assert next(lines).startswith("data: ")
                core = psutil.Process(harness.core_pid)
                core.suspend()
                core.kill()
                tail = [line for line in lines if line]
            assert tail[-1] == "data: [DONE]" and "engine_dead" in tail[-2]
            assert http.get("/ready").status_code == 503
            again = http.post("/v1/completions", json={**payload, "stream": False})
            assert again.status_code == 503 and again.json()["error"]["code"] == "engine_dead"
        with harness.channel() as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert wait_gone([core.pid], 5.0) == []
    finally:
        rest.stop()
        harness.stop()


def test_front_killed_takes_the_core_along(model: Path) -> None:
    served = serve(model)
    core_pid = served.core_pid
    assert core_pid in served.group()
    os.kill(served.proc.pid, signal.SIGKILL)
    served.proc.wait(timeout=30)
    assert wait_gone([core_pid], 5.0) == []
    assert served.group() == []


# ---------------------------------------------------------------------------- /metrics
@pytest.fixture(scope="module")
def keyed(tiny_model_with_tokenizer: Path) -> Iterator[Served]:
    served = serve(tiny_model_with_tokenizer, "--api-key", "k1")
    yield served
    served.proc.terminate()
    assert served.proc.wait(timeout=60) == 0


def test_metrics_need_the_key(keyed: Served) -> None:
    url = f"{keyed.rest_url}/metrics"
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "k1"}):
        reply = httpx.get(url, headers=headers, timeout=30)
        assert reply.status_code == 401 and "tokenwire:" not in reply.text
        assert reply.json()["error"]["code"] == "invalid_api_key"
    for scheme in ("Bearer", "bearer"):
        reply = httpx.get(url, headers={"authorization": f"{scheme} k1"}, timeout=30)
        assert reply.status_code == 200 and "tokenwire:num_requests_running" in reply.text
    # The schema stays open: it describes the API, not the server's state.
    assert httpx.get(f"{keyed.rest_url}/openapi.json", timeout=30).status_code == 200


def test_metrics_port_moves_metrics_off_the_rest_port(tiny_model_with_tokenizer: Path) -> None:
    served = serve(tiny_model_with_tokenizer, "--api-key", "k1", "--metrics-port", "0")
    try:
        port = None
        for line in served.lines:
            match = re.search(r'"metrics_port": (\d+)', line)
            if match:
                port = int(match.group(1))
        assert port is not None
        headers = {"authorization": "Bearer k1"}
        rest = httpx.get(f"{served.rest_url}/metrics", headers=headers, timeout=30)
        assert rest.status_code == 404
        own = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert own.status_code == 200 and "tokenwire:num_requests_running" in own.text
    finally:
        served.proc.terminate()
        assert served.proc.wait(timeout=60) == 0
