"""tokenwire in a fleet, for real: two ``tokenwire serve`` replicas (a tiny random model
with the default model's tokenizer and chat template) behind the real SMG gateway
(``smg launch``) over gRPC workers (the vLLM engine protocol, ``--worker-protocol vllm``)
and over HTTP workers (tokenwire's OpenAI REST shim), driven with the real OpenAI SDK.

The SIGTERM test runs last: it drains one replica for good.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from serve_process import Served, serve
from smg_gateway import MODEL, Gateway, replica_idle, start_gateway

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # two replicas + two gateways

MESSAGES = [{"role": "user", "content": "Name a city in France."}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def replicas(tiny_model_with_tokenizer: Path) -> Iterator[list[Served]]:
    flags = ("--served-model-name", MODEL, "--worker-protocol", "vllm", "--max-model-len", "512")
    with ThreadPoolExecutor(2) as pool:  # both load at once
        started = list(pool.map(lambda _: serve(tiny_model_with_tokenizer, *flags), range(2)))
    yield started
    for served in started:
        served.kill()


@pytest.fixture(scope="module")
def grpc_gateway(replicas: list[Served]) -> Iterator[Gateway]:
    urls = [f"grpc://{r.target}" for r in replicas]
    gateway = start_gateway(urls, "--policy", "round_robin")
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def http_gateway(replicas: list[Served]) -> Iterator[Gateway]:
    gateway = start_gateway([r.rest_url for r in replicas], "--policy", "round_robin")
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module", params=["grpc", "http"])
def gateway(request: pytest.FixtureRequest) -> Gateway:
    gw: Gateway = request.getfixturevalue(f"{request.param}_gateway")
    return gw


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def direct(replicas: list[Served]) -> Iterator[openai.OpenAI]:
    with client_of(replicas[0].rest_url) as client:
        yield client


def test_greedy_chat_and_completion_equal_direct(
    gateway: Gateway, direct: openai.OpenAI, replicas: list[Served]
) -> None:
    with client_of(gateway.url) as client:
        for _ in range(2):  # round robin: both replicas answer
            chat = client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=12,
                temperature=0,  # type: ignore[arg-type]
            )
            expected = direct.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=12,
                temperature=0,  # type: ignore[arg-type]
            )
            assert chat.choices[0].message.content == expected.choices[0].message.content
            assert chat.choices[0].finish_reason == expected.choices[0].finish_reason == "length"
            assert chat.usage is not None and expected.usage is not None
            assert chat.usage.prompt_tokens == expected.usage.prompt_tokens
        text = client.completions.create(
            model=MODEL, prompt="Hello there", max_tokens=10, temperature=0
        )
        want = direct.completions.create(
            model=MODEL, prompt="Hello there", max_tokens=10, temperature=0
        )
        assert text.choices[0].text == want.choices[0].text and text.choices[0].text


def test_streaming_equals_unary(gateway: Gateway) -> None:
    with client_of(gateway.url) as client:
        unary = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,  # type: ignore[arg-type]
        )
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=16,
                temperature=0,
                stream=True,  # type: ignore[arg-type]
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == unary.choices[0].message.content
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length"


def test_json_schema_and_tool_call(gateway: Gateway) -> None:
    with client_of(gateway.url) as client:
        answer = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is Paris in France?"}],
            max_tokens=200,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        )
        jsonschema.validate(json.loads(answer.choices[0].message.content or ""), SCHEMA)
        called = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather?"}],
            max_tokens=200,
            temperature=0,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
        )
        message = called.choices[0].message
        assert called.choices[0].finish_reason == "tool_calls" and message.tool_calls
        call = message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_invalid_request_names_the_field(gateway: Gateway) -> None:
    with client_of(gateway.url) as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100_000)  # type: ignore[arg-type]
    assert "max_tokens" in str(caught.value)
    assert "exceeds the model's context" in str(caught.value)


def test_disconnect_mid_stream_leaves_replicas_idle(
    gateway: Gateway, replicas: list[Served]
) -> None:
    for _ in range(2):  # round robin: one stream per replica
        with (
            httpx.Client(timeout=60) as http,
            http.stream(
                "POST",
                f"{gateway.url}/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": MESSAGES,
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "stream": True,
                },
            ) as reply,
        ):
            assert reply.status_code == 200
            lines = reply.iter_lines()
            got = [line for line in (next(lines) for _ in range(6)) if line.startswith("data:")]
            assert got  # tokens were flowing when the client went away
    for served in replicas:
        gauges = replica_idle(served)
        assert gauges["tokenwire:num_requests_running"] == 0, gauges
        assert gauges["tokenwire:kv_cache_free_blocks"] == gauges["tokenwire:kv_cache_num_blocks"]


def test_sigterm_drains_and_the_gateway_routes_around(
    replicas: list[Served], grpc_gateway: Gateway, http_gateway: Gateway
) -> None:
    """Replica 1 gets SIGTERM with a request in flight: that request completes in full, it
    exits 0, and every new request through either gateway succeeds (on replica 0)."""
    leaving = replicas[1]
    in_flight: list[openai.types.Completion] = []

    def long_request() -> None:
        with client_of(leaving.rest_url) as client:
            in_flight.append(
                client.completions.create(
                    model=MODEL,
                    prompt="Once upon a time",
                    max_tokens=120,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            )

    worker = threading.Thread(target=long_request)
    worker.start()
    replica_busy(leaving)
    leaving.proc.send_signal(signal.SIGTERM)
    for gw in (grpc_gateway, http_gateway):
        with client_of(gw.url) as client:
            for _ in range(6):
                reply = client.chat.completions.create(
                    model=MODEL,
                    messages=MESSAGES,
                    max_tokens=4,
                    temperature=0,  # type: ignore[arg-type]
                )
                assert reply.choices[0].finish_reason == "length"
    worker.join(60)
    assert in_flight and in_flight[0].usage is not None
    assert in_flight[0].usage.completion_tokens == 120
    assert leaving.proc.wait(timeout=60) == 0
    gauges = replica_idle(replicas[0])
    assert gauges["tokenwire:kv_cache_free_blocks"] == gauges["tokenwire:kv_cache_num_blocks"]


def replica_busy(served: Served, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while served.gauges()["tokenwire:num_requests_running"] == 0:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.05)  # an outside view of a subprocess: bounded poll
