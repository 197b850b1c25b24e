"""vLLM's /tokenize, /detokenize and render endpoints on the real shim over the real gRPC
server (issue 28 item 3): counts and ids equal the model's own tokenizer and chat template,
render generates nothing, /v1/models names the replica, bad input is a 400 naming the field."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import MODEL_NAME, ServerHarness

ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])  # a BatchEncoding


def test_tokenize_prompt_and_detokenize(http_client: httpx.Client, smollm_tokenizer: Any) -> None:
    reply = http_client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    expected = smollm_tokenizer("Hello world")["input_ids"]
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == 256
    assert body["token_strs"] == smollm_tokenizer.convert_ids_to_tokens(expected)
    back = http_client.post("/detokenize", json={"tokens": body["tokens"], "model": MODEL_NAME})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello world"}


def test_tokenize_messages_uses_the_chat_template(
    http_client: httpx.Client, smollm_tokenizer: Any
) -> None:
    reply = http_client.post("/tokenize", json={"model": MODEL_NAME, "messages": ASK})
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens"] == _chat_ids(smollm_tokenizer, ASK)
    assert reply.json()["token_strs"] is None


def test_render_endpoints_match_the_template_and_generate_nothing(
    http_client: httpx.Client, smollm_tokenizer: Any, harness: ServerHarness
) -> None:
    chat = http_client.post(
        "/v1/chat/completions/render",
        json={"model": MODEL_NAME, "messages": ASK, "max_tokens": 5, "temperature": 0.0},
    )
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["token_ids"] == _chat_ids(smollm_tokenizer, ASK)
    assert body["sampling_params"] == {"max_tokens": 5, "temperature": 0.0}
    assert body["model"] == MODEL_NAME and body["stream"] is False and body["request_id"]
    texts = http_client.post(
        "/v1/completions/render", json={"model": MODEL_NAME, "prompt": ["Hi there", "Bye"]}
    )
    assert texts.status_code == 200, texts.text
    expected = [smollm_tokenizer(t)["input_ids"] for t in ("Hi there", "Bye")]
    assert [i["token_ids"] for i in texts.json()] == expected
    ids = http_client.post("/v1/completions/render", json={"model": MODEL_NAME, "prompt": [5, 6]})
    assert [i["token_ids"] for i in ids.json()] == [[5, 6]]
    assert harness.engine.stats_snapshot().num_running == 0  # nothing was scheduled


def test_models_name_the_replica(http_client: httpx.Client, harness: ServerHarness) -> None:
    body = http_client.get("/v1/models").json()
    default = f"{socket.gethostname()}-{os.getpid()}"  # the harness serves in this process
    assert harness.server.settings.replica_id == default
    assert body["replica_id"] == default and body["data"][0]["replica_id"] == default


@pytest.mark.parametrize(
    ("path", "payload", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": ASK}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": ASK, "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [2**40]}, "tokens"),
        ("/detokenize", {}, "tokens"),
        ("/v1/chat/completions/render", {"model": MODEL_NAME, "messages": []}, "messages"),
        ("/v1/completions/render", {"model": MODEL_NAME}, "prompt"),
    ],
)
def test_bad_input_is_400_naming_the_field(
    http_client: httpx.Client, path: str, payload: dict[str, Any], param: str
) -> None:
    reply = http_client.post(path, json=payload)
    error = reply.json()["error"]
    if param == "model":  # an unknown model: OpenAI's 404 model_not_found
        assert reply.status_code == 404 and error["code"] == "model_not_found"
    else:
        assert reply.status_code == 400 and error["param"] == param, reply.text
