"""Telemetry of a real ``tokenwire serve`` subprocess (default model) exporting OTLP/gRPC to a
real trace receiver started here (opentelemetry-proto's TraceService): spans of streamed
gRPC and REST requests, the JSON log lines on its stdout, and ``/metrics``."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2_grpc,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from otlp_receiver import Receiver, attrs
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import DEFAULT_MODEL_TEST_KV_BYTES

from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.slow
API_KEY = "sk-telemetry-test-secret-8d1f"
AUTH = ("authorization", f"Bearer {API_KEY}")


@dataclass
class Served:
    proc: subprocess.Popen[str]
    grpc_target: str
    rest_url: str
    receiver: Receiver
    lines: list[str]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    receiver = Receiver()
    otlp = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, otlp)
    otlp_port = otlp.add_insecure_port("127.0.0.1:0")
    otlp.start()
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
    assert exe is not None
    cmd = [exe, "serve", "--grpc-port", "0", "--port", "0", "--api-key", API_KEY]
    cmd += ["--kv-cache-memory", str(DEFAULT_MODEL_TEST_KV_BYTES)]
    cmd += ["--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_port}", "--log-format", "json"]
    env = dict(os.environ, PYTHONSAFEPATH="1", OTEL_BSP_SCHEDULE_DELAY="100")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    lines: list[str] = []
    match = None
    for line in proc.stdout:  # blocks until the server reports its ports
        lines.append(line)
        match = re.search(r"serving model=.* grpc=(\S+:\d+) rest=(\S+)", line)
        if match:
            break
    assert match is not None, "server exited before serving:\n" + "".join(lines)
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    yield Served(proc, match.group(1), match.group(2), receiver, lines)
    proc.terminate()
    proc.wait(timeout=60)
    otlp.stop(0)


def traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def stream_request(max_tokens: int, prompt: list[int]) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingOptions(temperature=0.0),
        stopping=common_pb2.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
        cache_salt=uuid.uuid4().hex,
    )


def request_tree(receiver: Receiver, trace_id: str) -> tuple[Span, Span, list[Span], list[Span]]:
    """Wait for the request span in ``trace_id`` and all step spans linked to it; returns
    (rpc span, request span, its children, its steps)."""
    tid = bytes.fromhex(trace_id)

    def request_span(spans: list[Span]) -> Span | None:
        found = [s for s in spans if s.trace_id == tid and s.name == "tokenwire.request"]
        return found[0] if found else None

    def complete(spans: list[Span]) -> bool:
        req = request_span(spans)
        if req is None or not any(s.span_id == req.parent_span_id for s in spans):
            return False  # the RPC span ends (and is exported) after the request span
        wanted = len(attrs(req)["tokenwire.step_ids"])  # type: ignore[arg-type]
        return len(linked_steps(spans, req)) >= wanted

    spans = receiver.wait_for(complete)
    req = request_span(spans)
    assert req is not None
    rpc = [s for s in spans if s.span_id == req.parent_span_id]
    children = [s for s in spans if s.trace_id == tid and s.parent_span_id == req.span_id]
    return rpc[0], req, children, linked_steps(spans, req)


def linked_steps(spans: list[Span], req: Span) -> list[Span]:
    return [
        s
        for s in spans
        if s.name == "tokenwire.step" and any(link.span_id == req.span_id for link in s.links)
    ]


def check_tree(receiver: Receiver, trace_id: str, parent_id: str, max_tokens: int) -> Span:
    rpc, req, children, steps = request_tree(receiver, trace_id)
    assert rpc.name == "/tokenwire.v1.GenerationService/GenerateStream"
    assert rpc.parent_span_id == bytes.fromhex(parent_id)  # the caller's traceparent
    a = attrs(req)
    assert a["gen_ai.request.model"] == "SmolLM2-135M-Instruct"
    assert a["gen_ai.request.max_tokens"] == max_tokens
    assert a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.output_tokens"] == max_tokens
    assert a["gen_ai.usage.input_tokens"] > 0  # type: ignore[operator]
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.server.time_to_first_token"] > 0  # type: ignore[operator]
    assert "gen_ai.prompt" not in a and "gen_ai.completion" not in a  # content is off
    names = sorted(c.name for c in children)
    assert names.count("tokenwire.queue") == 1 and names.count("tokenwire.decode") == 1
    assert names.count("tokenwire.prefill") >= 1
    # Exactly one step span per step that served the request, each linked to it.
    step_ids = [attrs(s)["tokenwire.step.id"] for s in steps]
    assert sorted(step_ids) == a["tokenwire.step_ids"]
    assert len(step_ids) == len(set(step_ids)) == max_tokens  # 1 prefill + decode steps
    return req


def test_grpc_stream_trace_and_concurrent_steps(served: Served) -> None:
    tp, trace_id, parent_id = traceparent()
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        md = (AUTH, ("traceparent", tp), ("x-request-id", "trace-one"))
        events = list(stub.GenerateStream(stream_request(8, [1, 2, 3, 4, 5]), metadata=md))
        assert events[-1].WhichOneof("event") == "usage"
        check_tree(served.receiver, trace_id, parent_id, 8)
        # Two concurrent requests: some step serves both, and is linked to both.
        tps = [traceparent() for _ in range(2)]
        calls = [
            stub.GenerateStream(
                stream_request(12, [7, 8, 9, 10 + i]), metadata=(AUTH, ("traceparent", t[0]))
            )
            for i, t in enumerate(tps)
        ]
        for call in calls:
            list(call)
    reqs = [check_tree(served.receiver, t[1], t[2], 12) for t in tps]
    spans = served.receiver.wait_for(lambda s: True)
    both = [
        s
        for s in spans
        if s.name == "tokenwire.step"
        and {r.span_id for r in reqs} <= {link.span_id for link in s.links}
    ]
    assert both, "no step span is linked to both concurrent requests"
    assert attrs(both[0])["tokenwire.step.num_seqs"] >= 2  # type: ignore[operator]
    assert served.receiver.services == {"tokenwire"}


def session_turns(target: str, turns: list[tuple[list[int], str]]) -> list[int]:
    """One Session: each turn (token ids, traceparent) sent after the previous one ended;
    returns each turn's cached_tokens from TurnStarted."""
    outbox: queue.Queue[generation_pb2.SessionRequest | None] = queue.Queue()
    outbox.put(generation_pb2.SessionRequest(open=generation_pb2.SessionOpen(
        sampling=common_pb2.SamplingOptions(temperature=0.0),
        stopping=common_pb2.StoppingOptions(max_tokens=3, ignore_eos=True),
        cache_salt=uuid.uuid4().hex,
    )))  # fmt: skip

    def send_turn(ids: list[int], tp: str) -> None:
        turn = generation_pb2.SessionTurn(token_ids=common_pb2.TokenIds(ids=ids), traceparent=tp)
        outbox.put(generation_pb2.SessionRequest(turn=turn))

    cached: list[int] = []
    with grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        send_turn(*turns[0])
        for response in stub.Session(iter(outbox.get, None), metadata=(AUTH,), timeout=120):
            kind = response.WhichOneof("message")
            if kind == "turn_started":
                cached.append(response.turn_started.cached_tokens)
            elif kind == "turn_end":
                assert not response.turn_end.HasField("error")
                if len(cached) == len(turns):
                    outbox.put(generation_pb2.SessionRequest(close=generation_pb2.SessionClose()))
                    outbox.put(None)
                else:
                    send_turn(*turns[len(cached)])
    return cached


def test_session_turn_spans(served: Served) -> None:
    """One request span per turn, in the turn's own trace, parented by its traceparent."""
    tps = [traceparent() for _ in range(2)]
    first = list(range(40, 80))  # > 2 blocks, so turn 2 reuses the session's cached blocks
    cached = session_turns(served.grpc_target, [(first, tps[0][0]), ([5, 6, 7], tps[1][0])])
    assert cached[0] == 0 and cached[1] >= 32
    for (_, trace_id, parent_id), turn_cached in zip(tps, cached, strict=True):
        tid = bytes.fromhex(trace_id)
        spans = served.receiver.wait_for(
            lambda spans, tid=tid: any(
                s.trace_id == tid and s.name == "tokenwire.request" for s in spans
            )
        )
        (req,) = [s for s in spans if s.trace_id == tid and s.name == "tokenwire.request"]
        assert req.parent_span_id == bytes.fromhex(parent_id)
        a = attrs(req)
        assert a["tokenwire.request.kind"] == "session_turn"
        assert a["gen_ai.usage.output_tokens"] == 3
        assert a["tokenwire.usage.cached_tokens"] == turn_cached
        children = {s.name for s in spans if s.parent_span_id == req.span_id}
        assert children == {"tokenwire.queue", "tokenwire.prefill", "tokenwire.decode"}


def test_rest_stream_trace(served: Served) -> None:
    tp, trace_id, parent_id = traceparent()
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {API_KEY}", "traceparent": tp}
    with httpx.stream(
        "POST", f"{served.rest_url}/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    assert text.rstrip().endswith("data: [DONE]")
    req = check_tree(served.receiver, trace_id, parent_id, 6)
    assert attrs(req)["gen_ai.operation.name"] == "chat"


def test_logs_are_json_with_canonical_line(served: Served) -> None:
    tp, trace_id, _ = traceparent()
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        md = (AUTH, ("traceparent", tp), ("x-request-id", "log-check"))
        list(stub.GenerateStream(stream_request(4, [3, 1, 4, 1, 5]), metadata=md))
    _, req, _, _ = request_tree(served.receiver, trace_id)
    for _ in range(200):  # the canonical line follows the reply: bounded REST round trips
        if any("request_finished" in line and "log-check" in line for line in served.lines):
            break
        httpx.get(f"{served.rest_url}/health", timeout=10)
    lines = list(served.lines)
    records = [json.loads(line) for line in lines]  # every line is a JSON object
    assert all({"timestamp", "level", "logger", "event"} <= r.keys() for r in records)
    assert all(r["timestamp"].endswith("Z") for r in records)
    assert not any(API_KEY in line for line in lines)
    startup = next(r for r in records if r["event"].startswith("serving "))
    assert {"model", "device", "dtype", "kv_blocks", "grpc", "rest"} <= startup.keys()
    finished = [
        r for r in records if r["event"] == "request_finished" and r["request_id"] == "log-check"
    ]
    assert len(finished) == 1
    line = finished[0]
    assert line["trace_id"] == trace_id and line["span_id"] == req.span_id.hex()
    assert line["status"] == "OK" and line["finish_reason"] == "length"
    assert line["model"] == "SmolLM2-135M-Instruct"
    assert line["prompt_tokens"] == 5 and line["completion_tokens"] == 4
    assert line["cached_tokens"] == 0
    for key in ("queue_time_s", "ttft_s", "tpot_s", "e2e_s"):
        assert isinstance(line[key], float) and line[key] >= 0
    assert line["e2e_s"] >= line["ttft_s"] >= line["queue_time_s"]


def get_metrics(url: str) -> str:
    """``/metrics`` of a server with API keys: the key is needed, as for any other call."""
    refused = httpx.get(f"{url}/metrics", timeout=30)
    assert refused.status_code == 401 and "tokenwire:" not in refused.text
    reply = httpx.get(f"{url}/metrics", timeout=30, headers={AUTH[0]: AUTH[1]})
    assert reply.status_code == 200
    return reply.text


def scrape(url: str) -> dict[str, float]:
    text = get_metrics(url)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("tokenwire:"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def test_metrics_after_known_workload(served: Served) -> None:
    before = scrape(served.rest_url)
    workload = [([1, 2, 3, 4, 5], 4), ([9, 8, 7, 6, 5, 4, 3], 5), ([2] * 9, 6)]
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for prompt, max_tokens in workload:
            stub.Generate(stream_request(max_tokens, prompt), metadata=(AUTH,), timeout=120)
    after = scrape(served.rest_url)
    m = "model_name=SmolLM2-135M-Instruct"

    def delta(name: str, labels: str = m) -> float:
        key = f"tokenwire:{name}{{{labels}}}"
        return after[key] - before.get(key, 0.0)

    t = f"{m},tenant=default"  # per-request counters carry the tenant (--api-key: default)
    assert delta("prompt_tokens_total", t) == 21
    assert delta("generation_tokens_total", t) == 15
    assert delta("request_success_total", f"finish_reason=length,{t}") == 3
    assert delta("prefix_cache_queries_total") == 21
    assert delta("e2e_request_latency_seconds_count") == 3
    assert delta("time_to_first_token_seconds_count") == 3
    assert delta("request_queue_time_seconds_count") == 3
    assert delta("inter_token_latency_seconds_count") == 3 + 4 + 5
    assert delta("iteration_tokens_total_count") >= 6  # at least max_tokens steps
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[f"tokenwire:{gauge}{{{m}}}"] == 0.0
    text = get_metrics(served.rest_url)
    assert "process_cpu_seconds_total" in text
