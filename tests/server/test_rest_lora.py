"""LoRA adapters through the REST shim (in-process, tiny random llama with a tokenizer, PEFT
adapters made here): the official ``openai`` SDK selects adapters by ``model`` and sees them
in ``/v1/models`` with their base as ``parent``; unknown adapters are 404; vLLM's
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` load, and unload at runtime, behind
the API key (401) and ``--allow-runtime-lora-updating`` (403 when off), with bad paths and
adapters as 400s naming the field. The engine is idle with every KV block free after each."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from rest_harness import RestHarness
from server_harness import MODEL_NAME, ServerHarness

from tokenwire.runtime.config import LoRAConfig
from tokenwire.server.grpc.server import GrpcServer, GrpcSettings

KEY = "rest-lora-key"
PROMPT = [5, 17, 33, 101, 250, 7, 64, 300, 12]
CHAT = [{"role": "user", "content": "Say something."}]


def make_adapter(base: Path, out: Path, *, r: int, targets: list[str], seed: int) -> Path:
    """A random PEFT adapter (B nonzero: ``init_lora_weights=False``)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory: pytest.TempPathFactory, tiny_model_with_tokenizer: Path) -> Path:
    root = tmp_path_factory.mktemp("rest-lora-root")
    base = tiny_model_with_tokenizer
    make_adapter(base, root / "alpha", r=8, targets=["q_proj", "v_proj", "down_proj"], seed=11)
    make_adapter(base, root / "beta", r=4, targets=["k_proj", "o_proj", "up_proj"], seed=12)
    make_adapter(base, root / "lm-head", r=4, targets=["lm_head"], seed=13)
    shutil.copytree(root / "beta", root / "no-weights")
    (root / "no-weights" / "adapter_model.safetensors").unlink()
    return root


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options(lora_root: Path) -> dict[str, Any]:
    lora = LoRAConfig(
        enable_lora=True,
        lora_modules=(("alpha", str(lora_root / "alpha")),),
        max_loras=2,
        max_lora_rank=8,
    )
    return dict(
        api_keys=(KEY,), lora=lora, allow_runtime_lora_updating=True, lora_root=str(lora_root)
    )


@pytest.fixture(scope="module")
def http(rest: RestHarness) -> Iterator[httpx.Client]:
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=rest.url, headers=headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def flag_off_url(harness: ServerHarness) -> Iterator[str]:
    """The shim in front of a second gRPC server on the same engine, updates off."""

    async def start() -> GrpcServer:
        server = GrpcServer(harness.engine, MODEL_NAME, GrpcSettings(port=0, api_keys=(KEY,)))
        await server.start()
        await server.set_serving(True)
        return server

    server = harness.run(start())
    rest = RestHarness(harness, target=f"127.0.0.1:{server.port}").start()
    yield rest.url
    rest.stop()
    harness.run(server.stop(grace=0.5))


def completion_text(openai_client: openai.OpenAI, model: str) -> str:
    reply = openai_client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.model == model and reply.usage is not None
    assert reply.usage.completion_tokens == 8
    return reply.choices[0].text


def model_ids(openai_client: openai.OpenAI) -> list[tuple[str, Any]]:
    return [(m.id, m.to_dict().get("parent")) for m in openai_client.models.list()]


def error_of(response: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = response.json()["error"]
    return body


# ---------------------------------------------------------------------------- selection
def test_models_show_adapters_with_their_parent(openai_client: openai.OpenAI) -> None:
    assert model_ids(openai_client) == [(MODEL_NAME, None), ("alpha", MODEL_NAME)]
    alpha = openai_client.models.retrieve("alpha").to_dict()
    assert (alpha["id"], alpha["parent"], alpha["max_model_len"]) == ("alpha", MODEL_NAME, 256)
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("nope")


def test_sdk_selects_the_adapter_by_model(
    harness: ServerHarness, openai_client: openai.OpenAI
) -> None:
    base, alpha = (
        completion_text(openai_client, MODEL_NAME),
        completion_text(openai_client, "alpha"),
    )
    assert base != alpha  # the adapter changes the greedy tokens
    kwargs: dict[str, Any] = dict(model="alpha", messages=CHAT, temperature=0, max_tokens=8)
    unary = openai_client.chat.completions.create(**kwargs)
    assert unary.model == "alpha"
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True))
    assert {c.model for c in chunks} == {"alpha"}
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == unary.choices[0].message.content
    harness.assert_idle()


def test_unknown_adapter_is_404(harness: ServerHarness, openai_client: openai.OpenAI) -> None:
    calls = [
        lambda: openai_client.chat.completions.create(model="nope", messages=CHAT, max_tokens=2),  # type: ignore[arg-type]
        lambda: openai_client.chat.completions.create(
            model="nope",
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=2,
            stream=True,
        ),
        lambda: openai_client.completions.create(model="nope", prompt=PROMPT, max_tokens=2),
        lambda: openai_client.completions.create(
            model="nope", prompt=PROMPT, max_tokens=2, stream=True
        ),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.code == "model_not_found"
    harness.assert_idle()


# ---------------------------------------------------------------------------- runtime loads
def test_load_use_unload(
    harness: ServerHarness, openai_client: openai.OpenAI, http: httpx.Client
) -> None:
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": "beta"})
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'beta' added successfully."
    assert model_ids(openai_client)[-1] == ("beta", MODEL_NAME)
    beta = completion_text(openai_client, "beta")
    assert beta not in (
        completion_text(openai_client, MODEL_NAME),
        completion_text(openai_client, "alpha"),
    )
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": "beta"})
    assert again.status_code == 409
    assert (error_of(again)["code"], error_of(again)["param"]) == ("adapter_exists", "lora_name")
    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "beta"})
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.text == "Success: LoRA adapter 'beta' removed successfully."
    with pytest.raises(openai.NotFoundError):
        completion_text(openai_client, "beta")
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "beta"})
    assert gone.status_code == 404 and error_of(gone)["param"] == "lora_name"
    assert [m for m, _ in model_ids(openai_client)] == [MODEL_NAME, "alpha"]
    harness.assert_idle()


BAD_BODIES = [  # (route, body, the param the 400 must name)
    ("load", {"lora_name": "x"}, "lora_path"),
    ("load", {"lora_path": "beta"}, "lora_name"),
    ("load", {"lora_name": "x", "lora_path": "../outside"}, "lora_path"),
    ("load", {"lora_name": "x", "lora_path": "/etc"}, "lora_path"),
    ("load", {"lora_name": "x", "lora_path": "no-weights"}, "lora_path"),  # the engine's check
    ("load", {"lora_name": "x", "lora_path": "lm-head"}, "lora_path"),  # the engine's check
    ("load", {"lora_name": "x", "lora_path": "beta", "load_inplace": True}, "load_inplace"),
    ("load", {"lora_name": 3, "lora_path": "beta"}, "lora_name"),
    ("load", {"lora_name": "x", "lora_path": "beta", "extra": 1}, "extra"),
    ("unload", {}, "lora_name"),
    ("unload", {"lora_name": "alpha", "lora_int_id": 1}, "lora_int_id"),
]


@pytest.mark.parametrize(("route", "body", "param"), BAD_BODIES)
def test_bad_loads_are_400_naming_the_field(
    harness: ServerHarness,
    http: httpx.Client,
    openai_client: openai.OpenAI,
    lora_root: Path,
    route: str,
    body: dict[str, Any],
    param: str,
) -> None:
    response = http.post(f"/v1/{route}_lora_adapter", json=body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and param in error["message"]
    assert str(lora_root) not in error["message"]
    assert [m for m, _ in model_ids(openai_client)] == [MODEL_NAME, "alpha"]  # serving on
    completion_text(openai_client, "alpha")
    harness.assert_idle()


def test_load_routes_need_the_key_and_the_flag(
    harness: ServerHarness, rest: RestHarness, flag_off_url: str, openai_client: openai.OpenAI
) -> None:
    load = {"lora_name": "beta", "lora_path": "beta"}
    for headers in ({}, {"authorization": "Bearer wrong"}):
        with httpx.Client(base_url=rest.url, headers=headers, timeout=60) as anon:
            for route, body in (("load", load), ("unload", {"lora_name": "alpha"})):
                response = anon.post(f"/v1/{route}_lora_adapter", json=body)
                assert response.status_code == 401, response.text
                assert error_of(response)["code"] == "invalid_api_key"
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=flag_off_url, headers=headers, timeout=60) as off:
        for route, body in (("load", load), ("unload", {"lora_name": "alpha"})):
            response = off.post(f"/v1/{route}_lora_adapter", json=body)
            assert response.status_code == 403, response.text
            error = error_of(response)
            assert (error["type"], error["code"]) == ("permission_error", "lora_updating_disabled")
            assert "--allow-runtime-lora-updating" in error["message"]
    assert [m for m, _ in model_ids(openai_client)] == [MODEL_NAME, "alpha"]  # nothing changed
    harness.assert_idle()
