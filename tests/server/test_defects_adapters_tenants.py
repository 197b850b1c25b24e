"""No adapter-name oracle across tenants (real gRPC server and REST shim, tiny llama with a
LoRA adapter loaded at startup): for a tenant, a model or adapter name outside its list
is answered exactly like a name that does not exist at all, NOT_FOUND MODEL_NOT_FOUND (REST
404 ``model_not_found``), by every RPC and route that takes a name (Generate,
GenerateStream, Session, GetModelInfo, Tokenize, Detokenize, LoadAdapter, UnloadAdapter,
``/v1/models/{id}``, completions, chat completions, load / unload adapter); so no tenant can
tell which adapters other tenants have. Nothing changes on the server while it asks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from adapter_files import make_adapter
from grpc_helpers import details_of, greedy_request
from rest_harness import RestHarness
from server_harness import MODEL_NAME, ServerHarness

from tokenwire.runtime.config import LoRAConfig
from tokenwire.server.tenants.config import parse_tenants
from tokenwire.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    models_pb2,
    models_pb2_grpc,
)

TEAM = (("authorization", "Bearer k-team"),)  # may use the base model only
OWNER = (("authorization", "Bearer k-owner"),)  # may use the base model and "secret"
EXISTING, UNKNOWN = "secret", "nosuch"  # same length: messages compare character for character
TENANTS = {
    "tenants": [
        {"name": "team", "keys": ["plain:k-team"], "models": [MODEL_NAME]},
        {"name": "owner", "keys": ["plain:k-owner"], "models": [MODEL_NAME, EXISTING]},
    ]
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_model_with_tokenizer: Path) -> Path:
    root = tmp_path_factory.mktemp("tenant-lora-root")
    make_adapter(tiny_model_with_tokenizer, root / "good")
    return root


@pytest.fixture(scope="module")
def harness(tiny_model_with_tokenizer: Path, root: Path) -> Iterator[ServerHarness]:
    lora = LoRAConfig(
        enable_lora=True,
        lora_modules=((EXISTING, str(root / "good")),),
        max_loras=2,
        max_lora_rank=8,
    )
    h = ServerHarness(tiny_model_with_tokenizer, lora=lora, in_process=True)
    h.settings = dataclasses.replace(
        h.settings,
        tenants=parse_tenants(TENANTS),
        allow_runtime_lora_updating=True,
        lora_root=str(root),
    )
    h.start()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def channel(harness: ServerHarness) -> Iterator[grpc.Channel]:
    with harness.channel() as ch:
        yield ch


@pytest.fixture(scope="module")
def rest(harness: ServerHarness) -> Iterator[RestHarness]:
    r = RestHarness(harness).start()
    yield r
    r.stop()


# ---------------------------------------------------------------------------- gRPC probes
def _generate(ch: grpc.Channel, name: str) -> Any:
    request = greedy_request([5, 6, 7], 2)
    request.model = name
    return generation_pb2_grpc.GenerationServiceStub(ch).Generate(request, metadata=TEAM)


def _stream(ch: grpc.Channel, name: str) -> Any:
    request = greedy_request([5, 6, 7], 2)
    request.model = name
    return list(
        generation_pb2_grpc.GenerationServiceStub(ch).GenerateStream(request, metadata=TEAM)
    )


def _session(ch: grpc.Channel, name: str) -> Any:
    opening = generation_pb2.SessionRequest(open=generation_pb2.SessionOpen(model=name))
    turn = generation_pb2.SessionRequest(
        turn=generation_pb2.SessionTurn(token_ids=common_pb2.TokenIds(ids=[5, 6]))
    )
    stub = generation_pb2_grpc.GenerationServiceStub(ch)
    return list(stub.Session(iter([opening, turn]), metadata=TEAM, timeout=60))


def _models(ch: grpc.Channel) -> models_pb2_grpc.ModelServiceStub:
    return models_pb2_grpc.ModelServiceStub(ch)


GRPC_PROBES: dict[str, Callable[[grpc.Channel, str], Any]] = {
    "Generate": _generate,
    "GenerateStream": _stream,
    "Session": _session,
    "GetModelInfo": lambda ch, name: _models(ch).GetModelInfo(
        models_pb2.GetModelInfoRequest(model=name), metadata=TEAM
    ),
    "Tokenize": lambda ch, name: _models(ch).Tokenize(
        models_pb2.TokenizeRequest(text="hello", model=name), metadata=TEAM
    ),
    "Detokenize": lambda ch, name: _models(ch).Detokenize(
        models_pb2.DetokenizeRequest(token_ids=[5, 6], model=name), metadata=TEAM
    ),
    "LoadAdapter": lambda ch, name: _models(ch).LoadAdapter(
        models_pb2.LoadAdapterRequest(lora_name=name, lora_path="good"), metadata=TEAM
    ),
    "UnloadAdapter": lambda ch, name: _models(ch).UnloadAdapter(
        models_pb2.UnloadAdapterRequest(lora_name=name), metadata=TEAM
    ),
}


def grpc_answer(call: Callable[[], Any], name: str) -> tuple[Any, ...]:
    """What a caller can see of a failed call, with ``name`` written as <name>."""
    with pytest.raises(grpc.RpcError) as caught:
        call()
    err = caught.value
    info, _ = details_of(err)
    assert info is not None
    metadata = {k: v.replace(name, "<name>") for k, v in sorted(info.metadata.items())}
    return err.code(), info.reason, err.details().replace(name, "<name>"), metadata


def adapters_now(harness: ServerHarness) -> list[str]:
    return [a.lora_name for a in harness.engine.list_loras()]


@pytest.mark.parametrize("rpc", sorted(GRPC_PROBES))
def test_another_tenants_adapter_is_answered_like_an_unknown_name(
    harness: ServerHarness, channel: grpc.Channel, rpc: str
) -> None:
    probe = GRPC_PROBES[rpc]
    existing = grpc_answer(lambda: probe(channel, EXISTING), EXISTING)
    unknown = grpc_answer(lambda: probe(channel, UNKNOWN), UNKNOWN)
    assert existing == unknown
    assert existing[:2] == (grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND"), existing
    assert "team" not in existing[2]  # nothing about tenants or permissions
    assert adapters_now(harness) == [EXISTING]  # nothing changed
    harness.assert_idle()


def test_the_owner_still_uses_its_adapter_and_team_its_base(
    harness: ServerHarness, channel: grpc.Channel
) -> None:
    request = greedy_request([5, 6, 7], 2)
    request.model = EXISTING
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    assert stub.Generate(request, metadata=OWNER).model == EXISTING
    info = _models(channel).GetModelInfo(
        models_pb2.GetModelInfoRequest(model=EXISTING), metadata=OWNER
    )
    assert info.name == EXISTING
    assert len(_generate(channel, "").choices[0].token_ids) == 2
    listed = _models(channel).ListModels(models_pb2.ListModelsRequest(), metadata=TEAM).models
    assert [m.name for m in listed] == [MODEL_NAME]
    harness.assert_idle()


# ---------------------------------------------------------------------------- REST probes
REST_PROBES: dict[str, Callable[[str], tuple[str, str, dict[str, Any] | None]]] = {
    "get-model": lambda name: ("GET", f"/v1/models/{name}", None),
    "completions": lambda name: (
        "POST",
        "/v1/completions",
        {"model": name, "prompt": [5, 6], "max_tokens": 2},
    ),
    "chat": lambda name: (
        "POST",
        "/v1/chat/completions",
        {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ),
    "load": lambda name: (
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": name, "lora_path": "good"},
    ),
    "unload": lambda name: ("POST", "/v1/unload_lora_adapter", {"lora_name": name}),
}


def rest_answer(url: str, probe: str, name: str) -> tuple[int, Any]:
    method, path, body = REST_PROBES[probe](name)
    reply = httpx.request(
        method, url + path, json=body, headers={"authorization": "Bearer k-team"}, timeout=60
    )
    text = reply.text.replace(name, "<name>")
    return reply.status_code, text


@pytest.mark.parametrize("probe", sorted(REST_PROBES))
def test_rest_answers_another_tenants_adapter_like_an_unknown_name(
    harness: ServerHarness, rest: RestHarness, probe: str
) -> None:
    existing = rest_answer(rest.url, probe, EXISTING)
    unknown = rest_answer(rest.url, probe, UNKNOWN)
    assert existing == unknown
    assert existing[0] == 404 and "model_not_found" in existing[1], existing
    assert adapters_now(harness) == [EXISTING]
    harness.assert_idle()
