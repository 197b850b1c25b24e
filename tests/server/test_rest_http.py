"""The REST shim over raw HTTP, in-process on the tiny model (token-id prompts): response
shapes, streaming, choice indexing, logprobs, usage, request ids and forwarded headers,
parameter errors named in OpenAI terms, malformed and oversized bodies, unsupported fields."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from grpc_helpers import greedy_request
from server_harness import ServerHarness

from tokenwire.server.grpc import call_context
from tokenwire.server.grpc import generation as grpc_generation
from tokenwire.server.rest import middleware as rest_middleware
from tokenwire.server.rest import requests as rest_requests
from tokenwire.v1 import generation_pb2_grpc

PROMPT = [5, 6, 7]


def grpc_ids(harness: ServerHarness, prompt: list[int], max_tokens: int) -> list[int]:
    with harness.channel() as ch:
        reply = generation_pb2_grpc.GenerationServiceStub(ch).Generate(
            greedy_request(prompt, max_tokens)
        )
    return list(reply.choices[0].token_ids)


def completion(http_client: httpx.Client, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "ignore_eos": True, **fields}
    return http_client.post("/v1/completions", json=body)


def events(response: httpx.Response) -> list[Any]:
    """SSE payloads, ``"[DONE]"`` kept as a string; every event is a ``data:`` line."""
    blocks = [b for b in response.text.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks), blocks
    return [b[6:] if b == "data: [DONE]" else json.loads(b[6:]) for b in blocks]


def ids_of(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens)  # the tiny model has no tokenizer
    return [int(t.removeprefix("token_id:")) for t in tokens]


# ---------------------------------------------------------------------------- happy paths
def test_completion_shape_and_tokens(harness: ServerHarness, http_client: httpx.Client) -> None:
    want = grpc_ids(harness, PROMPT, 6)
    r = completion(http_client, max_tokens=6, logprobs=2)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["id"] == f"cmpl-{r.headers['x-request-id']}"
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert ids_of(lp["tokens"]) == want
    assert len(lp["token_logprobs"]) == 6 and all(x <= 0 for x in lp["token_logprobs"])
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"])
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "total_tokens": 9,
        "prompt_tokens_details": {
            "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"]
        },
    }
    harness.assert_idle()


def test_stream_equals_unary(harness: ServerHarness, http_client: httpx.Client) -> None:
    unary = completion(http_client, max_tokens=8, logprobs=0).json()["choices"][0]
    r = completion(http_client, max_tokens=8, logprobs=0, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r)
    assert evs[-1] == "[DONE]" and all("usage" not in e for e in evs[:-1])
    chunks = [c for e in evs[:-1] for c in e["choices"]]
    streamed = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert streamed == unary["logprobs"]["tokens"]
    assert "".join(c["text"] for c in chunks) == unary["text"]
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["length"]
    assert chunks[-1]["finish_reason"] == "length"  # the final chunk of the choice
    harness.assert_idle()


def test_prompts_times_n_indexing(harness: ServerHarness, http_client: httpx.Client) -> None:
    prompts = [[5, 6, 7], [9, 8]]
    want = [grpc_ids(harness, p, 4) for p in prompts]
    r = completion(http_client, prompt=prompts, n=2, max_tokens=4, logprobs=0)
    body = r.json()
    got = {c["index"]: ids_of(c["logprobs"]["tokens"]) for c in body["choices"]}
    assert got == {0: want[0], 1: want[0], 2: want[1], 3: want[1]}  # prompt i, choice j: i*n+j
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 16
    r = completion(
        http_client,
        prompt=prompts,
        n=2,
        max_tokens=4,
        logprobs=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    evs = events(r)
    assert evs[-1] == "[DONE]"
    usage_chunk = evs[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 16
    assert all(e["usage"] is None for e in evs[:-2])
    streamed: dict[int, list[int]] = {}
    finished: list[int] = []
    for chunk in (c for e in evs[:-2] for c in e["choices"]):
        if chunk["logprobs"]:
            streamed.setdefault(chunk["index"], []).extend(ids_of(chunk["logprobs"]["tokens"]))
        if chunk["finish_reason"]:
            finished.append(chunk["index"])
    assert streamed == got and sorted(finished) == [0, 1, 2, 3]
    harness.assert_idle()


def test_stop_token_and_stop_reason(harness: ServerHarness, http_client: httpx.Client) -> None:
    ids = grpc_ids(harness, PROMPT, 6)
    stop_id = ids[2]
    cut = ids.index(stop_id)  # the first occurrence ends the choice
    r = completion(http_client, max_tokens=6, logprobs=0, stop_token_ids=[stop_id])
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert len(choice["logprobs"]["tokens"]) == cut + 1
    harness.assert_idle()


def test_request_id_and_forwarded_headers(
    harness: ServerHarness, http_client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, str]] = []
    real = grpc_generation.call_context

    def record(context: grpc.aio.ServicerContext, *args: Any) -> Any:
        seen.append({m.key: m.value for m in context.invocation_metadata() or ()})
        return real(context, *args)

    monkeypatch.setattr(grpc_generation, "call_context", record)
    headers = {
        "x-request-id": "my-id-1",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "congo=t61rcWkgMzE",
        "authorization": "Bearer anything",
        "x-priority": "3",
    }
    r = http_client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2},
        headers=headers,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-1"
    assert r.json()["id"] == "cmpl-my-id-1"
    assert {k: seen[0].get(k) for k in headers} == headers
    generated = completion(http_client, max_tokens=1).headers["x-request-id"]
    assert len(generated) == 32 and seen[1]["x-request-id"] == generated
    r = completion(http_client, prompt=[PROMPT, PROMPT], max_tokens=1, logprobs=None)
    rid = r.headers["x-request-id"]
    assert {s["x-request-id"] for s in seen[2:]} == {f"{rid}-0", f"{rid}-1"}  # distinct ids
    harness.assert_idle()


def test_bad_headers_are_400_naming_them(http_client: httpx.Client) -> None:
    r = completion(http_client, max_tokens=1, logprobs=None, stream=False)
    assert r.status_code == 200
    for headers, param in (
        ({"x-request-id": "r" * 129}, "x-request-id"),  # the gRPC server's check
        ({"traceparent": "caf\u00e9"}, "traceparent"),  # not ASCII: never reaches gRPC
        ({"x-priority": "high"}, "x-priority"),
    ):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1}
        encoded = {k: v.encode() for k, v in headers.items()}
        r = http_client.post("/v1/completions", json=body, headers=encoded)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


BAD_REQUEST_IDS = {
    "utf-8": "\u00fcn\u00ef".encode(),
    "latin-1": "\u00fcn\u00ef".encode("latin-1"),
    "too-long": b"r" * 125,
    "tab": b"a\tb",
}


@pytest.mark.parametrize("raw", list(BAD_REQUEST_IDS.values()), ids=list(BAD_REQUEST_IDS))
def test_bad_request_id_is_400_with_a_fresh_id(
    harness: ServerHarness, http_client: httpx.Client, raw: bytes
) -> None:
    """The gRPC server's rule (printable ASCII, at most 128 characters, less room for a
    prompt index), checked by the shim before anything reaches gRPC: a 400 naming the
    header, never a 500 from grpc-core."""
    # The longest id the shim accepts still fits the gRPC rule once a prompt index is added.
    longest = "a" * rest_middleware.MAX_REQUEST_ID_CHARS + f"-{rest_requests.MAX_PROMPTS - 1}"
    assert len(longest) <= call_context.MAX_REQUEST_ID_CHARS
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1}
    for r in (
        http_client.post("/v1/completions", json=body, headers={"x-request-id": raw}),
        http_client.get("/v1/models/tiny", headers={"x-request-id": raw}),
    ):
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {
            "message": "header x-request-id must be printable ASCII, at most 124 characters",
            "type": "invalid_request_error",
            "param": "x-request-id",
            "code": "invalid_header",
        }
        fresh = r.headers["x-request-id"]  # a generated id, not the rejected one
        assert len(fresh) == 32 and fresh.isalnum()
    longest = "r" * rest_middleware.MAX_REQUEST_ID_CHARS
    r = http_client.post("/v1/completions", json=body, headers={"x-request-id": longest})
    assert r.status_code == 200 and r.headers["x-request-id"] == longest
    harness.assert_idle()


def test_meta_routes(http_client: httpx.Client) -> None:
    assert http_client.get("/health").json() == {"status": "ok"}
    assert http_client.get("/ready").json() == {"status": "ready"}
    models = http_client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    model = http_client.get("/v1/models/tiny").json()
    assert model["max_model_len"] == 256 and model["tensor_parallel_size"] == 1
    assert model["quantization"] is None and model["weight_bytes"] > 0
    spec = http_client.get("/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(spec["paths"])


def test_shim_imports_no_runtime() -> None:
    """The shim holds no model, tokenizer or engine: it never even imports the runtime."""
    code = (
        "import sys, tokenwire.server.rest.app, tokenwire.server.rest.server\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')\n"
        "       or m.startswith('tokenwire.runtime')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------------- 400s
PARAM_ERRORS = [  # (patch over a valid completion body, the param the error must name)
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 17}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"logit_bias": {"512": 1}}, "logit_bias"),  # outside the vocabulary (server check)
    ({"logit_bias": {"abc": 1}}, "logit_bias"),  # not a token id (shim check)
    ({"stop_token_ids": [512]}, "stop_token_ids"),
    ({"prompt": [5, 512]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"seed": -1}, "seed"),
    ({"top_k": 2**31}, "top_k"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"temperature": "0.5"}, "temperature"),  # wrong type: never coerced
    ({"n": 1.5}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"model": None}, "model"),
]


@pytest.mark.parametrize(("patch", "param"), PARAM_ERRORS, ids=[p for _, p in PARAM_ERRORS])
def test_bad_parameter_is_400_naming_it(
    http_client: httpx.Client, patch: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **patch}
    r = http_client.post("/v1/completions", json={k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param in error["message"]


def test_context_length_names_the_field(http_client: httpx.Client) -> None:
    for patch, param in (({"max_tokens": 7}, "max_tokens"), ({"max_tokens": None}, "prompt")):
        fields = {"prompt": [5] * (250 if patch["max_tokens"] else 256), **patch}
        error = completion(http_client, **fields).json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", param)


UNSUPPORTED = [
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
]


@pytest.mark.parametrize(("path", "patch", "param"), UNSUPPORTED, ids=[p for *_, p in UNSUPPORTED])
def test_unsupported_field_is_400_naming_it(
    http_client: httpx.Client, path: str, patch: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": "tiny", **patch}
    body.update(
        {"prompt": PROMPT}
        if "chat" not in path
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    error = http_client.post(path, json=body).json()["error"]
    assert error["param"] == param and param in error["message"]
    assert error["code"] in ("unsupported_parameter", "unknown_parameter")


def test_nested_and_unknown_fields(http_client: httpx.Client) -> None:
    def chat(message: dict[str, Any], **extra: Any) -> dict[str, Any]:
        body = {"model": "tiny", "messages": [message], **extra}
        return http_client.post("/v1/chat/completions", json=body).json()["error"]

    assert chat({"role": "user", "content": "hi", "name": "x"})["param"] == "messages.0.name"
    assert chat({"role": "tool", "content": "hi"})["param"] == "messages.0"  # no tool_call_id
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    assert chat({"role": "user", "content": [image]})["param"] == "messages.0.content.0"
    assert chat({"role": "user", "content": "hi"}, frobnicate=1)["code"] == "unknown_parameter"
    # Accepted no-op values still reach the server (which has no tokenizer for chat here).
    error = chat({"role": "user", "content": [{"type": "text", "text": "hi"}]}, tools=None)
    assert (error["param"], error["code"]) == ("messages", "invalid_parameter")
    assert completion(http_client, max_tokens=1, echo=False, user="u").status_code == 200


SURROGATES = [  # (route, patch, the failing string's path, the param named)
    ("/v1/completions", {"prompt": "\ud800x"}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": ["ok", "x\udfff"]}, "prompt.1", "prompt"),
    ("/v1/completions", {"model": "\ud800"}, "model", "model"),
    ("/v1/completions", {"stop": "\udc00"}, "stop", "stop"),
    ("/v1/completions", {"stop": ["a", "\ud800"]}, "stop.1", "stop"),
    ("/v1/completions", {"cache_salt": "\ud800"}, "cache_salt", "cache_salt"),
    ("/v1/completions", {"user": "\ud800"}, "user", "user"),
    ("/v1/chat/completions", {"stop": ["\ud800"]}, "stop.0", "stop"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\ud800"}]},
        "messages.1.content",
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]},
        "messages.0.content.0.text",
        "messages",
    ),
]


@pytest.mark.parametrize(
    ("path", "patch", "where", "param"), SURROGATES, ids=[s[2] for s in SURROGATES]
)
def test_lone_surrogate_is_400_naming_the_field(
    http_client: httpx.Client, path: str, patch: dict[str, Any], where: str, param: str
) -> None:
    """JSON can spell a lone UTF-16 surrogate, which no proto string can hold: a 400 naming
    where it is, for every string field (lists and content parts included), never a 500."""
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 1}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {})
    body.update({"prompt": PROMPT} if "chat" not in path else {})
    body.update(patch)
    raw = json.dumps(body).encode()  # ASCII with \u escapes: the surrogate stays lone
    r = http_client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value")
    assert error["message"].startswith(f"{where}: not valid Unicode")


def test_surrogates_elsewhere_and_real_unicode(http_client: httpx.Client) -> None:
    def post(body: dict[str, Any]) -> httpx.Response:
        raw = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 1, **body}).encode()
        return http_client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )

    r = post({"\ud800": 1})  # an object key: pydantic's own check, before "unknown field"
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert r.json()["error"]["message"].startswith("the request body: not valid Unicode")
    chat = {"model": "tiny", "messages": [{"role": "\ud800", "content": "hi"}]}
    r = http_client.post(
        "/v1/chat/completions",
        content=json.dumps(chat).encode(),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["message"].startswith("messages.0.role: not valid Unicode")
    r = post({"logit_bias": {"\ud800": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    # Valid non-ASCII text (a surrogate *pair* is one character) is fine.
    r = post({"stop": ["\u00e9", "\ud83d\ude00"], "user": "\u00fc"})
    assert r.status_code == 200, r.text


def test_echoed_client_input_is_clipped(http_client: httpx.Client) -> None:
    """The shim's own messages quote at most 256 characters of what the client sent."""
    long = "b" * 8000
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi", long: 1}]}
    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": PROMPT, long: 1}),
        ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "logit_bias": {long: 1}}),
        ("/v1/chat/completions", chat),
    ):
        r = http_client.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert len(error["message"]) < 400 and len(error["param"]) < 300, error
        assert "b" * 256 + "\u2026" in error["message"] and "b" * 257 not in r.text


@pytest.mark.parametrize("raw", [b"{", b"[1]", b'"x"', b"5", b"null", b"", b"\xff\xfe"])
def test_malformed_body_is_400(http_client: httpx.Client, raw: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = http_client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, raw, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_body_size_limit_is_413(http_client: httpx.Client) -> None:
    big = json.dumps({"model": "tiny", "prompt": "x" * (2 << 20)}).encode()
    r = http_client.post(
        "/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no content-length: counted while reading
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    r = http_client.post(
        "/v1/completions", content=chunked(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method(http_client: httpx.Client) -> None:
    r = http_client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = http_client.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
