"""What a real ``tokenwire serve`` reports about its requests (defects issue, items 13 and 15):

- a response over the send limit (``--max-send-message-bytes``) reaches the client as
  RESOURCE_EXHAUSTED with ErrorInfo RESPONSE_TOO_LARGE, and the canonical ``request_finished``
  line and the request metrics say so too (not OK / finish_reason "length"); grpc's raw
  ExecuteBatchError traceback never reaches the log. Unary, server streaming, a session turn
  (in-band) and a ModelService call are checked.
- the startup warm-up request is nobody's request: no request metric, no tenant label, no
  ``request_finished`` line.

JSON logs on the server's stdout, ``/metrics`` on its REST port, generated stubs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_helpers import details_of
from prometheus_client.parser import text_string_to_metric_families
from serve_process import Served, serve

from tokenwire.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    models_pb2,
    models_pb2_grpc,
)

pytestmark = pytest.mark.slow
SEND_LIMIT = 400  # bytes: a start event fits, a few tokens with 20 logprobs each do not


@pytest.fixture(scope="module")
def served(tiny_model_with_tokenizer: Path) -> Iterator[Served]:
    server = serve(tiny_model_with_tokenizer, "--max-send-message-bytes", str(SEND_LIMIT))
    yield server
    server.kill()


def request_metrics(served: Served) -> dict[tuple[str, str], float]:
    """(sample name, sorted labels without model_name) -> value, request counters only."""
    text = httpx.get(f"{served.rest_url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            created = sample.name.endswith("_created")  # a timestamp, not a count
            if sample.name.startswith("tokenwire:") and sample.value and not created:
                labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
                out[(sample.name, json.dumps(labels, sort_keys=True))] = sample.value
    return out


def log_events(served: Served) -> list[dict[str, Any]]:
    events = []
    for line in list(served.lines):
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def finished_lines(served: Served, request_id: str) -> list[dict[str, Any]]:
    return [
        e
        for e in log_events(served)
        if e.get("event") == "request_finished" and request_id in str(e.get("request_id"))
    ]


def big_request(request_id: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[5, 6, 7, 8]),
        request_id=request_id,
        sampling=common_pb2.SamplingOptions(temperature=0.0),
        stopping=common_pb2.StoppingOptions(max_tokens=24, ignore_eos=True),
        output=common_pb2.OutputOptions(logprobs=20),
    )


def wait_logged(served: Served, request_id: str) -> dict[str, Any]:
    """The request's canonical line (the server logs it when the call ends: poll the
    reader's lines a bounded number of times through a cheap RPC round trip)."""
    with grpc.insecure_channel(served.target) as ch:
        stub = models_pb2_grpc.ModelServiceStub(ch)
        for _ in range(200):
            lines = finished_lines(served, request_id)
            if lines:
                (line,) = lines
                return line
            stub.ListModels(models_pb2.ListModelsRequest(), timeout=10)
    raise AssertionError(f"no request_finished line for {request_id}")


def test_warmup_is_not_a_request(served: Served) -> None:
    """Before any client request: no request metric at all, no request_finished line."""
    metrics = request_metrics(served)
    counted = [
        key
        for key in metrics
        if "tenant" in key[1]
        or key[0].startswith(
            (
                "tokenwire:e2e_request_latency",
                "tokenwire:time_to_first_token",
                "tokenwire:request_queue_time",
                "tokenwire:prefix_cache_queries",
                "tokenwire:iteration_tokens",
            )
        )
    ]
    assert counted == [], counted
    assert not [e for e in log_events(served) if e.get("event") == "request_finished"]


def _expect_too_large(err: grpc.RpcError) -> None:
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    info, _ = details_of(err)
    assert info is not None and info.reason == "RESPONSE_TOO_LARGE", err
    assert "--max-send-message-bytes" in err.details()


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_oversized_response_is_reported_as_the_client_saw_it(served: Served, method: str) -> None:
    before = request_metrics(served)
    rid = f"too-large-{method}"
    with grpc.insecure_channel(served.target) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        with pytest.raises(grpc.RpcError) as caught:
            if method == "Generate":
                stub.Generate(big_request(rid), timeout=60)
            else:
                list(stub.GenerateStream(big_request(rid), timeout=60))
    _expect_too_large(caught.value)
    line = wait_logged(served, rid)
    assert line["status"] == "RESOURCE_EXHAUSTED", line
    after = request_metrics(served)
    success = "tokenwire:request_success_total"
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if k[0] == success}
    delta = {k: v for k, v in delta.items() if v}
    assert delta == {(success, '{"finish_reason": "error", "tenant": "anonymous"}'): 1.0}
    assert not [line for line in served.lines if "ExecuteBatchError" in line]


def test_oversized_session_delta_fails_the_turn_in_band(served: Served) -> None:
    opening = generation_pb2.SessionRequest(open=generation_pb2.SessionOpen())
    big = big_request("")
    turn = generation_pb2.SessionRequest(
        turn=generation_pb2.SessionTurn(
            token_ids=big.token_ids, sampling=big.sampling, stopping=big.stopping, output=big.output
        )
    )
    close = generation_pb2.SessionRequest(close=generation_pb2.SessionClose())
    with grpc.insecure_channel(served.target) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        replies = list(stub.Session(iter([opening, turn, close]), timeout=60))
    session_id = replies[0].opened.session_id
    (end,) = [r.turn_end for r in replies if r.HasField("turn_end")]
    assert end.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], end
    assert "--max-send-message-bytes" in end.error.message
    line = wait_logged(served, f"{session_id}/turn-1")
    assert line["status"] == "RESOURCE_EXHAUSTED", line
    assert not [line for line in served.lines if "ExecuteBatchError" in line]


def test_oversized_model_service_answer(served: Served) -> None:
    with grpc.insecure_channel(served.target) as ch:
        stub = models_pb2_grpc.ModelServiceStub(ch)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Tokenize(models_pb2.TokenizeRequest(text="hello world " * 200), timeout=30)
    _expect_too_large(caught.value)
    assert not [line for line in served.lines if "ExecuteBatchError" in line]
