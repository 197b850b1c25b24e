"""SageMaker's ``/ping`` and ``/invocations`` and vLLM's ``/version`` (``rest/sagemaker``) on
a real server and REST shim: ``/invocations`` answers as the route its body's fields name
(greedy completions and chat equal the direct routes' answers, a stream streams, the route's
own validation names the bad field), a body naming no route is a 400 naming ``body``."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest
from rest_harness import RestHarness
from server_harness import MODEL_NAME

GREEDY: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": 5}


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512, in_process=True)


def _post(rest: RestHarness, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{rest.url}{path}", json=body, timeout=120)


def test_ping_and_version(rest: RestHarness) -> None:
    for method in ("GET", "POST"):
        reply = httpx.request(method, f"{rest.url}/ping", timeout=30)
        assert (reply.status_code, reply.json()) == (200, {"status": "ready"})
    reply = httpx.get(f"{rest.url}/version", timeout=30)
    assert reply.status_code == 200 and reply.json() == {"version": version("tokenwire")}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {**GREEDY, "prompt": "Hello there"}),
        ("/v1/chat/completions", {**GREEDY, "messages": [{"role": "user", "content": "Hi"}]}),
    ],
)
def test_invocations_answer_as_the_named_route(
    rest: RestHarness, path: str, body: dict[str, Any]
) -> None:
    direct, invoked = _post(rest, path, body), _post(rest, "/invocations", body)
    assert direct.status_code == invoked.status_code == 200
    want, got = direct.json(), invoked.json()
    assert got["object"] == want["object"]
    assert got["choices"] == want["choices"]
    for count in ("prompt_tokens", "completion_tokens"):  # the second hits the prefix cache
        assert got["usage"][count] == want["usage"][count]
    assert invoked.headers["x-request-id"]


def test_an_invoked_stream_streams(rest: RestHarness) -> None:
    body = {**GREEDY, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    with httpx.stream("POST", f"{rest.url}/invocations", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert len(events) >= 3 and events[-1] == "data: [DONE]"


def test_the_routes_own_errors_and_embeddings_dispatch(rest: RestHarness) -> None:
    bad = _post(rest, "/invocations", {**GREEDY, "prompt": "Hi", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    embed = {"model": MODEL_NAME, "input": "Hello"}  # a generation model: the route refuses
    direct, invoked = _post(rest, "/v1/embeddings", embed), _post(rest, "/invocations", embed)
    assert invoked.status_code == direct.status_code != 200
    assert invoked.json()["error"]["code"] == direct.json()["error"]["code"]


@pytest.mark.parametrize("body", [{"model": MODEL_NAME}, ["prompt"], {"query": "q"}])
def test_a_body_naming_no_route_is_a_400_naming_body(rest: RestHarness, body: Any) -> None:
    reply = _post(rest, "/invocations", body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "body"
    raw = httpx.post(f"{rest.url}/invocations", content=b"{not json", timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "body"
