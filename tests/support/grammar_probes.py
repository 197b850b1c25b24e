"""Schema bombs and the probes that show the event loop stays responsive while one is refused."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import greedy_request

from tokenwire.v1 import common_pb2, generation_pb2_grpc
from tokenwire.v1 import generation_pb2 as pb

HEALTH_BOUND_S = 1.5  # slowest health answer while a bomb is in flight (2 CPU cores)


SMALL_GENERATE_BOUND_S = 3.0  # an unrelated 4-token Generate sent beside the bomb


def nested_arrays(depth: int) -> dict[str, Any]:
    """The reported bomb: arrays nested ``depth`` deep (450: ~12 KB, seconds to parse)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


BOMB = json.dumps(nested_arrays(450))


class HealthProbe:
    """Health checks back to back on a channel of their own, in a thread."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with grpc.insecure_channel(self.target) as ch:
            check = health_pb2_grpc.HealthStub(ch).Check
            check(health_pb2.HealthCheckRequest(), timeout=10)
            self._ready.set()
            while not self._stop.is_set():
                t0 = time.perf_counter()
                reply = check(health_pb2.HealthCheckRequest(), timeout=30)
                self.latencies.append(time.perf_counter() - t0)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def assert_free(self) -> None:
        assert self.latencies, "no health answer while the request was in flight"
        assert max(self.latencies) < HEALTH_BOUND_S, max(self.latencies)


def chat_request(
    structured: common_pb2.StructuredOutput | None = None, **chat: Any
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        chat=common_pb2.ChatInput(
            messages=[common_pb2.ChatMessage(role="user", content="Hi")], **chat
        ),
        stopping=common_pb2.StoppingOptions(max_tokens=8),
        output=common_pb2.OutputOptions(structured_output=structured),
    )


def small_generate(target: str) -> float:
    """Seconds an unrelated 4-token Generate takes (on a channel of its own)."""
    with grpc.insecure_channel(target) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        t0 = time.perf_counter()
        reply = stub.Generate(greedy_request([5, 6, 7], 4), timeout=60)
        elapsed = time.perf_counter() - t0
    assert reply.usage.completion_tokens == 4
    return elapsed
