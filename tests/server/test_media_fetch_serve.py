"""Remote image URLs served end to end (#33): a tiny random LLaVA behind the gRPC server and
two REST shims, one without ``--allowed-media-domains`` (remote URLs refused, naming the
flag) and one allowing ``127.0.0.1`` with the tests-only ``allow_private`` (a real HTTP server
on loopback serves the PNG). A fetched PNG gives the same greedy tokens as the same PNG sent
as a ``data:`` URL, on chat (the real OpenAI SDK) and on the Responses API; refusals name the
part (``messages.<i>.content.<j>``, ``input.<i>.content.<j>``); the fetched bytes count with
the body against ``--max-request-body-bytes``."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from rest_harness import RestHarness
from server_harness import ServerHarness
from tiny_llava import save_tiny_llava, synthetic_image

from tokenwire.server.rest.media_fetch import MediaFetchPolicy

IMAGE_TOKEN = 4
NEW_TOKENS = 6


def _png(seed: int) -> bytes:
    out = io.BytesIO()
    synthetic_image(seed).save(out, format="PNG")
    return out.getvalue()


IMAGES = {"/one.png": _png(1), "/two.png": _png(2)}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = IMAGES.get(self.path)
        if body is None:
            self.send_response(302 if self.path == "/moved" else 404)
            self.send_header("location", "/one.png")
            self.send_header("content-length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("content-type", "image/png")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def harness_model(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any) -> Path:
    path = tmp_path_factory.mktemp("llava-remote")
    save_tiny_llava(path, len(smollm_tokenizer), IMAGE_TOKEN, max_position=512)
    smollm_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def fetching(harness: ServerHarness) -> Iterator[RestHarness]:
    policy = MediaFetchPolicy(frozenset({"127.0.0.1", "localhost"}), 1 << 20, 10.0, True)
    rest = RestHarness(harness, media=policy).start()
    yield rest
    rest.stop()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _chat(client: openai.OpenAI, url: str) -> list[int]:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]
    completion = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        temperature=0.0,
        max_tokens=NEW_TOKENS,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    content = completion.choices[0].logprobs.content  # type: ignore[union-attr]
    return [int(t.token.removeprefix("token_id:")) for t in content or []]


def _sdk(rest: RestHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{rest.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_a_fetched_png_reaches_the_model_as_its_data_url_does(
    fetching: RestHarness, origin: str, harness: ServerHarness
) -> None:
    with _sdk(fetching) as client:
        remote = _chat(client, f"{origin}/one.png")
        assert len(remote) == NEW_TOKENS
        assert remote == _chat(client, _data_url(IMAGES["/one.png"]))
        assert _chat(client, f"{origin}/two.png") == _chat(client, _data_url(IMAGES["/two.png"]))
    harness.assert_idle()


def test_responses_input_image_is_fetched_too(fetching: RestHarness, origin: str) -> None:
    def output_of(url: str) -> Any:
        body = {
            "model": "tiny",
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Look: "},
                        {"type": "input_image", "image_url": url},
                    ],
                }
            ],
            "temperature": 0.0,
            "max_output_tokens": NEW_TOKENS,
            "store": False,
        }
        r = httpx.post(f"{fetching.url}/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()
        return answer["output"][0]["content"][0]["text"], answer["usage"]["input_tokens"]

    assert output_of(f"{origin}/two.png") == output_of(_data_url(IMAGES["/two.png"]))


def _error(rest: RestHarness, url: str) -> Any:
    with _sdk(rest) as client, pytest.raises(openai.BadRequestError) as info:
        _chat(client, url)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "messages.0.content.1", error
    assert error["type"] == "invalid_request_error"
    return error["message"]


def test_without_the_flag_remote_urls_are_refused_naming_it(rest: RestHarness, origin: str) -> None:
    assert "--allowed-media-domains" in _error(rest, f"{origin}/one.png")


def test_refusals_name_the_part(fetching: RestHarness, origin: str) -> None:
    port = origin.rsplit(":", 1)[1]
    assert "not in --allowed-media-domains" in _error(fetching, f"http://example.com:{port}/x")
    assert "HTTP 404" in _error(fetching, f"{origin}/missing.png")
    assert "redirects (302)" in _error(fetching, f"{origin}/moved")
    strict = MediaFetchPolicy(frozenset({"localhost"}), 1 << 20)
    rest = RestHarness(fetching.harness, media=strict).start()
    try:
        message = _error(rest, f"http://localhost:{port}/one.png")
        assert "private or reserved address" in message
    finally:
        rest.stop()


def test_fetched_bytes_count_against_the_body_limit(fetching: RestHarness, origin: str) -> None:
    """``--max-request-body-bytes`` bounds the body plus the images fetched for it: one image
    fits (served, the real SDK), two do not (a 400 naming the part that crossed it and the
    flag), on chat and on the Responses API."""
    limit = len(IMAGES["/one.png"]) + 3000  # a body is well under 3000 bytes
    policy = MediaFetchPolicy(frozenset({"127.0.0.1"}), 1 << 20, 10.0, True)
    rest = RestHarness(fetching.harness, media=policy, max_body_bytes=limit).start()
    try:
        with _sdk(rest) as client:
            assert len(_chat(client, f"{origin}/one.png")) == NEW_TOKENS
        image = {"type": "image_url", "image_url": {"url": f"{origin}/one.png"}}
        messages = [{"role": "user", "content": [{"type": "text", "text": "x"}, image, image]}]
        chat = httpx.post(
            f"{rest.url}/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "max_tokens": 1},
            timeout=120,
        )
        parts = [{"type": "input_image", "image_url": f"{origin}/two.png"}] * 2
        responses = httpx.post(
            f"{rest.url}/v1/responses",
            json={"model": "tiny", "input": [{"role": "user", "content": parts}]},
            timeout=120,
        )
    finally:
        rest.stop()
    for r, param in ((chat, "messages.0.content.2"), (responses, "input.0.content.1")):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param
        assert f"over {limit} bytes (--max-request-body-bytes)" in error["message"]
