"""Faults of a real ``tokenwire serve`` subprocess tree (tiny model, loopback):

- SIGTERM under load: every in-flight stream (gRPC and REST) completes in full within
  ``--shutdown-timeout``, new calls get UNAVAILABLE, the process exits 0, nothing is left;
- an engine fault injected mid-step (``TOKENWIRE_TEST_FAULT=step:N``, runtime/engine/fault.py):
  today the core loop ends and the front declares the engine dead, so every in-flight call
  ends UNAVAILABLE / ENGINE_DEAD (REST: an in-band ``engine_dead`` error) within seconds,
  health turns NOT_SERVING, new calls fail fast with UNAVAILABLE, and the server exits 1
  with no process left behind. Never a hang;
- the fault plan's parsing, and the KV gauges after a session closes at idle.
"""

from __future__ import annotations

import json
import queue
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import details_of, greedy_request
from serve_process import Served, serve, wait_gone

from tokenwire.runtime.engine.fault import FAULT_ENV, FaultPlan, InjectedFault, StepFault
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pb = generation_pb2
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WARMUP_STEPS = 2  # the server's warm-up request: a prefill step and one decode step
FAIL_WITHIN_S = 10.0  # every in-flight call of a dead engine has ended by then


# ---------------------------------------------------------------------------- the plan
def test_fault_plan_from_env() -> None:
    assert FaultPlan.from_env({}) is None
    assert FaultPlan.from_env({FAULT_ENV: ""}) is None
    assert FaultPlan.from_env({FAULT_ENV: "step:7"}) == FaultPlan(7)
    assert FaultPlan.from_env({FAULT_ENV: "slow:250"}) == FaultPlan(0, slow_ms=250)
    assert FaultPlan.from_env({FAULT_ENV: "step:9, slow:20"}) == FaultPlan(9, slow_ms=20)
    bad_plans = ("step:0", "step:", "step:x", "boom", "kill:3", "slow:0", "slow:-1")
    for bad in (*bad_plans, "step:3,step:4", "step:3,slow:0", "step:3,", "step:3;slow:5"):
        with pytest.raises(ValueError, match=FAULT_ENV):
            FaultPlan.from_env({FAULT_ENV: bad})


def test_step_fault_raises_once_at_the_nth_call() -> None:
    fault = StepFault(FaultPlan(3))
    fault.before_execute()
    fault.before_execute()
    with pytest.raises(InjectedFault, match="call 3"):
        fault.before_execute()
    fault.before_execute()  # once only
    assert fault.calls == 4


# ---------------------------------------------------------------------------- helpers
def in_thread(fn: Callable[[], Any]) -> queue.Queue[Any]:
    """Run ``fn`` on a thread; its result (or exception) lands in the returned queue."""
    out: queue.Queue[Any] = queue.Queue()

    def run() -> None:
        try:
            out.put(fn())
        except Exception as exc:
            out.put(exc)

    threading.Thread(target=run, daemon=True).start()
    return out


def grpc_stream(stub: Any, request_id: str, max_tokens: int) -> tuple[Any, queue.Queue[Any]]:
    """Start a stream, wait for its start event (admitted by the engine), read the rest on a
    thread: (finish reasons, delta token count) or the ``RpcError``."""
    call = stub.GenerateStream(greedy_request([5, 6, 7], max_tokens, request_id=request_id))
    assert next(call).HasField("start")

    def rest() -> tuple[list[int], int]:
        events = list(call)
        ends = [e.end.finish_reason for e in events if e.HasField("end")]
        return ends, sum(len(e.delta.token_ids) for e in events if e.HasField("delta"))

    return call, in_thread(rest)


def rest_stream(url: str, model: str, max_tokens: int) -> queue.Queue[Any]:
    """Start a REST completion stream, wait for its first chunk, read the rest on a thread:
    the list of ``data:`` payloads (``[DONE]`` last)."""
    body: dict[str, Any] = {"model": model, "prompt": [5, 6, 7], "max_tokens": max_tokens}
    body.update(stream=True, ignore_eos=True, temperature=0.0)
    body["stream_options"] = {"include_usage": True}
    first = threading.Event()

    def run() -> list[str]:
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", f"{url}/v1/completions", json=body) as reply,
        ):
            assert reply.status_code == 200
            lines = []
            for line in reply.iter_lines():
                if line:
                    lines.append(line.removeprefix("data: "))
                    first.set()
            return lines

    out = in_thread(run)
    # A stream that ended before its first chunk (a refusal, an error) says what it got.
    for _ in range(120):
        if first.wait(0.5) or not out.empty():
            break
    assert first.is_set(), f"the REST stream never started: {list(out.queue)!r}"
    return out


def model_id(served: Served) -> str:
    return str(httpx.get(f"{served.rest_url}/v1/models", timeout=30).json()["data"][0]["id"])


def finished(payloads: list[str]) -> tuple[list[str], int]:
    """REST stream payloads -> (finish reasons, completion tokens of the usage chunk)."""
    chunks = [json.loads(p) for p in payloads if p != "[DONE]"]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    usage = [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")]
    return [r for r in reasons if r], usage[-1] if usage else -1


# ---------------------------------------------------------------------------- SIGTERM
def test_session_close_then_sigterm_under_load(tiny_model_with_tokenizer: Path) -> None:
    served = serve(
        tiny_model_with_tokenizer, "--num-gpu-blocks-override", "64", "--shutdown-timeout", "30"
    )
    try:
        check_session_close_frees_blocks(served)
        check_sigterm_under_load(served)
    finally:
        served.kill()


def check_session_close_frees_blocks(served: Served) -> None:
    """A session holds its blocks between turns; closing it at idle (no step follows) must
    still bring the gauges back to every block free."""
    outbox: queue.Queue[pb.SessionRequest | None] = queue.Queue()
    with grpc.insecure_channel(served.target) as channel:
        call = generation_pb2_grpc.GenerationServiceStub(channel).Session(
            iter(outbox.get, None), timeout=60
        )
        stopping = common_pb2.StoppingOptions(max_tokens=8, ignore_eos=True)
        outbox.put(pb.SessionRequest(open=pb.SessionOpen(stopping=stopping)))
        turn = pb.SessionTurn(token_ids=common_pb2.TokenIds(ids=list(range(5, 60))))
        outbox.put(pb.SessionRequest(turn=turn))
        while next(call).WhichOneof("message") != "turn_end":
            pass
        held = served.gauges()
        assert held["tokenwire:kv_cache_free_blocks"] < held["tokenwire:kv_cache_num_blocks"]
        outbox.put(pb.SessionRequest(close=pb.SessionClose()))
        outbox.put(None)
        assert list(call) == []
    deadline = time.monotonic() + 10
    while True:  # the release reaches the core asynchronously; bounded poll from outside
        gauges = served.gauges()
        if gauges["tokenwire:kv_cache_free_blocks"] == gauges["tokenwire:kv_cache_num_blocks"]:
            break
        assert time.monotonic() < deadline, f"blocks still held after Close: {gauges}"
        time.sleep(0.1)
    assert gauges["tokenwire:kv_cache_usage_perc"] == 0.0


def check_sigterm_under_load(served: Served) -> None:
    """N long streams in flight, SIGTERM: all complete in full, zero dropped, exit 0."""
    max_tokens, shutdown_timeout = 80, 30.0  # the server's --shutdown-timeout
    model = model_id(served)
    with grpc.insecure_channel(served.target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        grpc_out = [grpc_stream(stub, f"drain-{i}", max_tokens)[1] for i in range(4)]
        rest_out = [rest_stream(served.rest_url, model, max_tokens) for _ in range(2)]
        sent = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert any(reply.status == NOT_SERVING for reply in health)  # ends when it stops
        with pytest.raises(grpc.RpcError) as refused:  # new work is refused while draining
            stub.Generate(greedy_request([1, 2, 3], 2), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        grpc_results = [out.get(timeout=shutdown_timeout) for out in grpc_out]
        rest_results = [out.get(timeout=shutdown_timeout) for out in rest_out]
    drained_in = time.monotonic() - sent
    for result in grpc_results:  # nothing dropped: every stream ran to its length
        assert result == ([common_pb2.FINISH_REASON_LENGTH], max_tokens), result
    for payloads in rest_results:
        assert not isinstance(payloads, Exception), payloads
        assert payloads[-1] == "[DONE]" and not any('"error"' in p for p in payloads)
        assert finished(payloads) == (["length"], max_tokens)
    assert drained_in < shutdown_timeout
    assert served.proc.wait(timeout=60) == 0
    assert wait_gone(served.group(), 10.0) == []


# ---------------------------------------------------------------------------- engine fault
FAULT_AT = WARMUP_STEPS + 60  # well after the streams below are admitted, long before done
# Every step takes this much longer, so the 60 steps before the fault last >= 3 s: the calls
# below are all admitted by then however loaded the box (a tiny model alone steps in ~1 ms, and
# one CI run saw the fault land before the second stream's start).
FAULT_SLOW_MS = 50
BEFORE_FAULT_S = FAULT_AT * FAULT_SLOW_MS / 1000


def test_engine_fault_mid_step(tiny_model_with_tokenizer: Path) -> None:
    plan = f"step:{FAULT_AT},slow:{FAULT_SLOW_MS}"
    served = serve(tiny_model_with_tokenizer, env={FAULT_ENV: plan})
    try:
        check_engine_fault(served)
    finally:
        served.kill()


def check_engine_fault(served: Served) -> None:
    max_tokens = 200  # no stream can finish before the fault
    model = model_id(served)
    with grpc.insecure_channel(served.target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert next(watch).status == SERVING
        streams = [grpc_stream(stub, f"victim-{i}", max_tokens) for i in range(2)]
        rest_out = rest_stream(served.rest_url, model, max_tokens)
        unary = stub.Generate.future(greedy_request([5, 6, 7], max_tokens), timeout=120)
        started = time.monotonic()
        results = [out.get(timeout=120) for _, out in streams]
        payloads = rest_out.get(timeout=120)
        with pytest.raises(grpc.RpcError) as unary_error:
            unary.result(timeout=120)
        ended_within = time.monotonic() - started
        assert next(watch).status == NOT_SERVING
        refused_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:  # fails fast, never hangs
            stub.Generate(greedy_request([1, 2, 3], 2), timeout=30)
        refused_in = time.monotonic() - refused_at
    for (call, _), result in zip(streams, results, strict=True):
        assert isinstance(result, grpc.RpcError), result  # the streams did not complete
        assert call.code() == grpc.StatusCode.UNAVAILABLE
        info, _ = details_of(result)
        assert info is not None and info.reason == "ENGINE_DEAD"
    assert not isinstance(payloads, Exception), payloads
    assert payloads[-1] == "[DONE]" and "engine_dead" in payloads[-2]
    assert unary_error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert ended_within < BEFORE_FAULT_S + FAIL_WITHIN_S
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and refused_in < 5.0
    assert served.proc.wait(timeout=60) == 1  # a supervisor restarts it
    assert wait_gone(served.group(), 10.0) == []
    assert any("InjectedFault" in line for line in served.lines)
