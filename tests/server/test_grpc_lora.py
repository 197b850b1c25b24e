"""LoRA adapters over the gRPC API (real server, tiny random llama with a tokenizer, PEFT
adapters made here): a request's ``model`` selects an adapter (Generate, GenerateStream,
Session), ListModels / GetModelInfo / Tokenize know adapters, unknown names are NOT_FOUND,
LoadAdapter / UnloadAdapter at runtime (flag, key, --lora-root path rule, bad adapters that
leave the server serving, unloading under an in-flight stream), the lora_requests_info gauge
and ``gen_ai.request.model`` on request spans. The engine is idle with every KV block free
after each scenario."""

from __future__ import annotations

import os
import queue
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_helpers import Recorder, delta_ids, details_of, greedy_request, spy_on
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL_NAME, ServerHarness

from tokenwire.runtime.config import LoRAConfig
from tokenwire.runtime.engine.protocol import EngineStatsSnapshot
from tokenwire.server.cli import main
from tokenwire.server.grpc.server import GrpcServer, GrpcSettings
from tokenwire.server.telemetry.core import Telemetry
from tokenwire.server.tenants.config import parse_tenants
from tokenwire.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    models_pb2,
    models_pb2_grpc,
)

KEY = "lora-admin-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
PROMPT = [5, 17, 33, 101, 250, 7, 64, 300, 12]
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_LORA_RANK = 8


def make_adapter(base: Path, out: Path, *, r: int, targets: list[str], seed: int) -> Path:
    """A random PEFT adapter (B nonzero: ``init_lora_weights=False``) for the model in
    ``base``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    return out


@dataclass(frozen=True)
class Adapters:
    root: Path  # --lora-root
    outside: Path  # a valid adapter outside the root


@pytest.fixture(scope="module")
def adapters(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_with_tokenizer: Path,
    tiny_model_factory: Callable[..., Path],
) -> Adapters:
    base = tiny_model_with_tokenizer
    root = tmp_path_factory.mktemp("lora-root")
    make_adapter(base, root / "alpha", r=8, targets=ALL_TARGETS, seed=1)
    make_adapter(base, root / "beta", r=4, targets=["q_proj", "v_proj", "o_proj"], seed=2)
    # Bad ones: rank above --max-lora-rank, a target the engine does not serve, shapes of
    # another model (hidden size 32), weights missing, an empty directory.
    make_adapter(base, root / "big-rank", r=2 * MAX_LORA_RANK, targets=["q_proj"], seed=3)
    make_adapter(base, root / "lm-head", r=4, targets=["lm_head"], seed=4)
    narrow = tiny_model_factory("llama", hidden_size=32, intermediate_size=64)
    make_adapter(narrow, root / "other-shape", r=4, targets=["q_proj", "v_proj"], seed=5)
    shutil.copytree(root / "beta", root / "no-weights")
    (root / "no-weights" / "adapter_model.safetensors").unlink()
    (root / "empty").mkdir()
    outside = tmp_path_factory.mktemp("outside") / "adapter"
    shutil.copytree(root / "beta", outside)
    os.symlink(outside, root / "escape")
    return Adapters(root, outside)


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options(adapters: Adapters) -> dict[str, Any]:
    lora = LoRAConfig(
        enable_lora=True,
        lora_modules=(("alpha", str(adapters.root / "alpha")),),
        max_loras=2,
        max_lora_rank=MAX_LORA_RANK,
        max_cpu_loras=4,
    )
    return dict(
        api_keys=(KEY,),
        observer=Recorder(),
        lora=lora,
        allow_runtime_lora_updating=True,
        lora_root=str(adapters.root),
    )


@pytest.fixture(scope="module")
def models(channel: grpc.Channel) -> models_pb2_grpc.ModelServiceStub:
    return models_pb2_grpc.ModelServiceStub(channel)


@dataclass
class SideServer:
    """A second gRPC server over the same engine: runtime updates off, tracing on."""

    server: GrpcServer
    exporter: InMemorySpanExporter
    target: str


@pytest.fixture(scope="module")
def side(harness: ServerHarness) -> Iterator[SideServer]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry(provider=provider)

    async def start() -> SideServer:
        server = GrpcServer(
            harness.engine, MODEL_NAME, GrpcSettings(port=0, api_keys=(KEY,)), telemetry
        )
        port = await server.start()
        await server.set_serving(True)
        return SideServer(server, exporter, f"127.0.0.1:{port}")

    s = harness.run(start())
    yield s
    harness.run(s.server.stop(grace=0.5))


def ids(reply: generation_pb2.GenerateResponse) -> list[int]:
    return list(reply.choices[0].token_ids)


def generate(
    gen: generation_pb2_grpc.GenerationServiceStub, model: str, max_tokens: int = 10
) -> generation_pb2.GenerateResponse:
    request = greedy_request(PROMPT, max_tokens)
    request.model = model
    reply: generation_pb2.GenerateResponse = gen.Generate(request, metadata=AUTH, timeout=60)
    return reply


def expect_error(
    call: Callable[[], Any], code: grpc.StatusCode, reason: str, param: str | None = None
) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    err = caught.value
    assert err.code() == code, err.details()
    info, _ = details_of(err)
    assert info is not None and info.reason == reason, info
    if param is not None:
        assert info.metadata["param"] == param, info.metadata
    return err


# ---------------------------------------------------------------------------- selection
def test_models_list_the_base_and_its_adapters(
    harness: ServerHarness, models: models_pb2_grpc.ModelServiceStub
) -> None:
    listed = models.ListModels(models_pb2.ListModelsRequest(), metadata=AUTH).models
    assert [(m.name, m.parent) for m in listed] == [(MODEL_NAME, ""), ("alpha", MODEL_NAME)]
    assert listed[1].max_context_tokens == listed[0].max_context_tokens == 256
    info = models.GetModelInfo(models_pb2.GetModelInfoRequest(model="alpha"), metadata=AUTH)
    assert (info.name, info.parent) == ("alpha", MODEL_NAME)
    server = models.GetServerInfo(models_pb2.GetServerInfoRequest(), metadata=AUTH)
    assert (server.max_loras, server.max_lora_rank, server.runtime_lora_updating) == (
        2,
        MAX_LORA_RANK,
        True,
    )
    # Same tokenizer as the base model.
    tokenize = models_pb2.TokenizeRequest(text="Hello there", model="alpha")
    by_adapter = models.Tokenize(tokenize, metadata=AUTH)
    tokenize.model = ""
    assert by_adapter.token_ids == models.Tokenize(tokenize, metadata=AUTH).token_ids
    detok = models_pb2.DetokenizeRequest(token_ids=by_adapter.token_ids, model="alpha")
    assert models.Detokenize(detok, metadata=AUTH).text == "Hello there"
    for call in (
        lambda: models.GetModelInfo(models_pb2.GetModelInfoRequest(model="nope"), metadata=AUTH),
        lambda: models.Tokenize(models_pb2.TokenizeRequest(text="x", model="nope"), metadata=AUTH),
    ):
        expect_error(call, grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND")


def test_adapter_changes_the_output_on_every_rpc(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub
) -> None:
    base, named_base = generate(gen, ""), generate(gen, MODEL_NAME)
    alpha = generate(gen, "alpha")
    assert ids(base) == ids(named_base) and base.model == MODEL_NAME
    assert alpha.model == "alpha" and len(ids(alpha)) == 10
    assert ids(alpha) != ids(base)  # B is nonzero: the adapter changes the greedy tokens

    request = greedy_request(PROMPT, 10)
    request.model = "alpha"
    events = list(gen.GenerateStream(request, metadata=AUTH, timeout=60))
    assert events[0].start.model == "alpha"
    assert delta_ids(events) == ids(alpha)

    # A session binds its adapter at Open.
    messages = [
        generation_pb2.SessionRequest(
            open=generation_pb2.SessionOpen(
                model="alpha",
                sampling=common_pb2.SamplingOptions(temperature=0.0),
                stopping=common_pb2.StoppingOptions(max_tokens=10, ignore_eos=True),
            )
        ),
        generation_pb2.SessionRequest(
            turn=generation_pb2.SessionTurn(token_ids=common_pb2.TokenIds(ids=PROMPT))
        ),
    ]
    replies = list(gen.Session(iter(messages), metadata=AUTH, timeout=60))
    assert replies[0].opened.model == "alpha"
    turn_ids = [t for r in replies if r.HasField("delta") for t in r.delta.delta.token_ids]
    assert turn_ids == ids(alpha)
    ends = [r.turn_end for r in replies if r.HasField("turn_end")]
    assert len(ends) == 1 and not ends[0].HasField("error")
    harness.assert_idle()


def test_unknown_adapter_is_not_found_everywhere(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub
) -> None:
    request = greedy_request(PROMPT, 4)
    request.model = "nope"
    not_found = (grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND")
    expect_error(lambda: gen.Generate(request, metadata=AUTH), *not_found)
    expect_error(lambda: list(gen.GenerateStream(request, metadata=AUTH)), *not_found)
    opening = generation_pb2.SessionRequest(open=generation_pb2.SessionOpen(model="nope"))
    expect_error(lambda: list(gen.Session(iter([opening]), metadata=AUTH)), *not_found)
    harness.assert_idle()


# ---------------------------------------------------------------------------- runtime loads
def load(models: models_pb2_grpc.ModelServiceStub, name: str, path: str) -> models_pb2.ModelInfo:
    request = models_pb2.LoadAdapterRequest(lora_name=name, lora_path=path)
    reply: models_pb2.LoadAdapterResponse = models.LoadAdapter(request, metadata=AUTH, timeout=60)
    return reply.model


def unload(models: models_pb2_grpc.ModelServiceStub, name: str) -> None:
    request = models_pb2.UnloadAdapterRequest(lora_name=name)
    models.UnloadAdapter(request, metadata=AUTH, timeout=60)


def names(models: models_pb2_grpc.ModelServiceStub) -> list[str]:
    return [m.name for m in models.ListModels(models_pb2.ListModelsRequest(), metadata=AUTH).models]


def test_load_use_unload_and_reload(
    harness: ServerHarness,
    gen: generation_pb2_grpc.GenerationServiceStub,
    models: models_pb2_grpc.ModelServiceStub,
    adapters: Adapters,
) -> None:
    info = load(models, "beta", "beta")  # relative to --lora-root
    assert (info.name, info.parent) == ("beta", MODEL_NAME)
    assert names(models) == [MODEL_NAME, "alpha", "beta"]
    beta = ids(generate(gen, "beta"))
    assert beta not in (ids(generate(gen, "")), ids(generate(gen, "alpha")))
    expect_error(
        lambda: load(models, "beta", "beta"),
        grpc.StatusCode.ALREADY_EXISTS,
        "ADAPTER_EXISTS",
        "lora_name",
    )
    unload(models, "beta")
    assert names(models) == [MODEL_NAME, "alpha"]
    expect_error(lambda: generate(gen, "beta"), grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND")
    expect_error(
        lambda: unload(models, "beta"), grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND", "lora_name"
    )
    # Loaded again (an absolute path inside the root this time): the same tokens.
    load(models, "beta", str(adapters.root / "beta"))
    assert ids(generate(gen, "beta")) == beta
    unload(models, "beta")
    harness.assert_idle()


def test_unload_lets_an_in_flight_stream_finish(
    harness: ServerHarness,
    gen: generation_pb2_grpc.GenerationServiceStub,
    models: models_pb2_grpc.ModelServiceStub,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    load(models, "gamma", "beta")
    expected = ids(generate(gen, "gamma", max_tokens=24))
    recorder = harness.observer
    assert isinstance(recorder, Recorder)
    request = greedy_request(PROMPT, 24, request_id="unload-under-me")
    request.model = "gamma"
    remove = spy_on(monkeypatch, harness.engine, "remove_lora")
    recorder.hold("unload-under-me", nth=4)  # park the core mid-stream
    try:
        stream = gen.GenerateStream(request, metadata=AUTH, timeout=60)
        assert recorder.parked.wait(30)
        metrics = metric_samples(harness.server.telemetry.exposition())
        [info] = metrics["tokenwire:lora_requests_info"]
        assert info.labels["running_lora_adapters"] == "gamma" and info.labels["max_lora"] == "2"
        with ThreadPoolExecutor(1) as pool:
            unloading = pool.submit(unload, models, "gamma")
            remove.wait("gamma")
            # New requests cannot select it at once, while the stream is still in the core.
            expect_error(
                lambda: generate(gen, "gamma"), grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND"
            )
            recorder.release()
            events = list(stream)
            unloading.result(timeout=60)
    finally:
        recorder.release()
    assert delta_ids(events) == expected  # the adapter stayed in effect to the end
    [end] = [e.end for e in events if e.HasField("end")]
    assert end.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert "gamma" not in names(models)
    harness.assert_idle()
    [idle] = metric_samples(harness.server.telemetry.exposition())["tokenwire:lora_requests_info"]
    assert idle.labels["running_lora_adapters"] == idle.labels["waiting_lora_adapters"] == ""


def test_a_session_whose_adapter_was_unloaded_fails_its_next_turn_in_band(
    harness: ServerHarness,
    gen: generation_pb2_grpc.GenerationServiceStub,
    models: models_pb2_grpc.ModelServiceStub,
) -> None:
    load(models, "delta", "beta")
    outbox: queue.Queue[generation_pb2.SessionRequest | None] = queue.Queue()
    turn = generation_pb2.SessionRequest(
        turn=generation_pb2.SessionTurn(token_ids=common_pb2.TokenIds(ids=PROMPT))
    )
    outbox.put(
        generation_pb2.SessionRequest(
            open=generation_pb2.SessionOpen(
                model="delta",
                sampling=common_pb2.SamplingOptions(temperature=0.0),
                stopping=common_pb2.StoppingOptions(max_tokens=3, ignore_eos=True),
            )
        )
    )
    outbox.put(turn)
    replies = gen.Session(iter(outbox.get, None), metadata=AUTH, timeout=60)
    first = [next(replies)]
    while not first[-1].HasField("turn_end"):
        first.append(next(replies))
    assert first[0].opened.model == "delta" and not first[-1].turn_end.HasField("error")
    unload(models, "delta")
    outbox.put(turn)
    second = next(r for r in replies if r.HasField("turn_end")).turn_end
    assert second.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    outbox.put(None)  # half-close: the session ends
    assert list(replies) == []
    harness.assert_idle()


BAD_LOADS = [  # (lora_name, lora_path, the param the error must name, text in its message)
    ("big", "big-rank", "lora_path", "adapter_config.json:r: rank 16 exceeds --max-lora-rank"),
    ("head", "lm-head", "lora_path", "unsupported target module"),
    ("shape", "other-shape", "lora_path", "has shape [4, 32], the model needs [4, 64]"),
    ("noweights", "no-weights", "lora_path", "no adapter_model.safetensors"),
    ("empty", "empty", "lora_path", "no adapter_config.json"),
    ("missing", "no-such-adapter", "lora_path", "no adapter directory"),
    ("dotdot", "<relative-outside>", "lora_path", "inside the server's --lora-root"),
    ("symlink", "escape", "lora_path", "inside the server's --lora-root"),
    ("absolute", "<outside>", "lora_path", "inside the server's --lora-root"),
    ("nopath", "", "lora_path", "is required"),
    ("", "beta", "lora_name", "is required"),
    (MODEL_NAME, "beta", "lora_name", "base model's name"),
    ("two words", "beta", "lora_name", "without spaces"),
]


@pytest.mark.parametrize(
    ("name", "path", "param", "text"), BAD_LOADS, ids=[b[1] or b[0] for b in BAD_LOADS]
)
def test_bad_adapter_is_invalid_argument_and_the_server_serves_on(
    harness: ServerHarness,
    gen: generation_pb2_grpc.GenerationServiceStub,
    models: models_pb2_grpc.ModelServiceStub,
    adapters: Adapters,
    name: str,
    path: str,
    param: str,
    text: str,
) -> None:
    if path == "<outside>":
        path = str(adapters.outside)
    elif path == "<relative-outside>":
        path = os.path.relpath(adapters.outside, adapters.root)  # ../outside0/adapter
        assert path.startswith("../")
    before = ids(generate(gen, "alpha", max_tokens=4))
    err = expect_error(
        lambda: load(models, name, path), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PARAMETER"
    )
    info, _ = details_of(err)
    assert info is not None and info.metadata["param"] == param
    assert err.details().startswith(f"{param}: ") and text in err.details()
    # Never the resolved path or the root.
    assert str(adapters.root) not in err.details() and str(adapters.outside) not in err.details()
    assert names(models) == [MODEL_NAME, "alpha"]
    assert ids(generate(gen, "alpha", max_tokens=4)) == before
    harness.assert_idle()


# ---------------------------------------------------------------------------- auth and flags
def test_updates_need_the_key_and_the_flag(
    harness: ServerHarness, models: models_pb2_grpc.ModelServiceStub, side: SideServer
) -> None:
    loading = models_pb2.LoadAdapterRequest(lora_name="beta", lora_path="beta")
    unloading = models_pb2.UnloadAdapterRequest(lora_name="alpha")
    for call in (
        lambda: models.LoadAdapter(loading),
        lambda: models.UnloadAdapter(unloading),
        lambda: models.LoadAdapter(loading, metadata=(("authorization", "Bearer wrong"),)),
    ):
        expect_error(call, grpc.StatusCode.UNAUTHENTICATED, "API_KEY_INVALID")
    with grpc.insecure_channel(side.target) as ch:
        off = models_pb2_grpc.ModelServiceStub(ch)
        for call in (
            lambda: off.LoadAdapter(loading, metadata=AUTH),
            lambda: off.UnloadAdapter(unloading, metadata=AUTH),
        ):
            err = expect_error(call, grpc.StatusCode.PERMISSION_DENIED, "LORA_UPDATING_DISABLED")
            assert "--allow-runtime-lora-updating" in err.details()
        server = off.GetServerInfo(models_pb2.GetServerInfoRequest(), metadata=AUTH)
        assert not server.runtime_lora_updating
    assert names(models) == [MODEL_NAME, "alpha"]  # nothing changed
    harness.assert_idle()


def test_tenants_manage_only_the_adapters_they_may_use(
    harness: ServerHarness, models: models_pb2_grpc.ModelServiceStub, adapters: Adapters
) -> None:
    """With a key file, LoadAdapter / UnloadAdapter of a name outside the caller's tenant
    list is NOT_FOUND MODEL_NOT_FOUND (as for a name that is not loaded: no oracle) and
    changes nothing; a name on it works."""
    config = parse_tenants(
        {"tenants": [{"name": "team", "keys": ["plain:kt"], "models": [MODEL_NAME, "gamma"]}]}
    )
    settings = GrpcSettings(
        port=0, tenants=config, allow_runtime_lora_updating=True, lora_root=str(adapters.root)
    )

    async def start() -> tuple[GrpcServer, int]:
        server = GrpcServer(harness.engine, MODEL_NAME, settings, Telemetry())
        port = await server.start()
        await server.set_serving(True)
        return server, port

    server, port = harness.run(start())
    team = (("authorization", "Bearer kt"),)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = models_pb2_grpc.ModelServiceStub(ch)
            for call in (
                lambda: stub.LoadAdapter(
                    models_pb2.LoadAdapterRequest(lora_name="beta", lora_path="beta"),
                    metadata=team,
                ),
                lambda: stub.UnloadAdapter(
                    models_pb2.UnloadAdapterRequest(lora_name="alpha"), metadata=team
                ),
            ):
                err = expect_error(call, grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND", "lora_name")
                assert "is not served here" in err.details() and "team" not in err.details()
            assert names(models) == [MODEL_NAME, "alpha"]  # nothing changed
            gamma = models_pb2.LoadAdapterRequest(lora_name="gamma", lora_path="beta")
            assert stub.LoadAdapter(gamma, metadata=team).model.name == "gamma"
            assert names(models) == [MODEL_NAME, "alpha", "gamma"]
            stub.UnloadAdapter(models_pb2.UnloadAdapterRequest(lora_name="gamma"), metadata=team)
    finally:
        harness.run(server.stop(grace=0.5))
    assert names(models) == [MODEL_NAME, "alpha"]
    harness.assert_idle()


def test_request_spans_carry_the_adapter_name(harness: ServerHarness, side: SideServer) -> None:
    side.exporter.clear()
    with grpc.insecure_channel(side.target) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        for model in ("alpha", ""):
            request = greedy_request(PROMPT, 3, request_id=f"span-{model or 'base'}")
            request.model = model
            stub.Generate(request, metadata=AUTH, timeout=60)
    spans = {
        s.attributes["tokenwire.request_id"]: s.attributes["gen_ai.request.model"]
        for s in side.exporter.get_finished_spans()
        if s.name == "tokenwire.request" and s.attributes is not None
    }
    assert spans == {"span-alpha": "alpha", "span-base": MODEL_NAME}
    harness.assert_idle()


def test_runtime_updating_flag_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="--allow-runtime-lora-updating needs --api-key"):
        GrpcSettings(allow_runtime_lora_updating=True, lora_root=str(tmp_path))
    with pytest.raises(ValueError, match="needs --lora-root"):
        GrpcSettings(allow_runtime_lora_updating=True, api_keys=(KEY,))
    with pytest.raises(ValueError, match="--lora-root"):
        GrpcSettings(api_keys=(KEY,), lora_root=str(tmp_path / "absent"))
    assert not GrpcSettings().allow_runtime_lora_updating  # off by default
    serve = ["serve", "--grpc-port", "0", "--port", "0", "--allow-runtime-lora-updating"]
    assert main(serve) == 2
    assert "--allow-runtime-lora-updating needs --api-key" in capsys.readouterr().err
    keyed = [*serve, "--api-key", KEY, "--lora-root", str(tmp_path)]
    assert main(keyed) == 2
    assert "--allow-runtime-lora-updating needs --enable-lora" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the gauge
def metric_samples(text: bytes) -> dict[str, list[Any]]:
    families = text_string_to_metric_families(text.decode())
    return {f.name: list(f.samples) for f in families}


def test_lora_requests_info_gauge_labels() -> None:
    snapshot = EngineStatsSnapshot(
        running_lora_adapters=("b", "a", "b"), waiting_lora_adapters=("c",)
    )
    engine = SimpleNamespace(
        info=SimpleNamespace(served_model_name="m", max_loras=3),
        stats_snapshot=lambda: snapshot,
    )
    telemetry = Telemetry()
    telemetry.attach(engine)  # type: ignore[arg-type]
    [sample] = metric_samples(telemetry.exposition())["tokenwire:lora_requests_info"]
    assert sample.labels == {
        "model_name": "m",
        "max_lora": "3",
        "running_lora_adapters": "a,b",
        "waiting_lora_adapters": "c",
    }
    assert sample.value > 1.6e9  # a Unix time
    engine.info.max_loras = 0  # LoRA off: no series
    telemetry.attach(engine)  # type: ignore[arg-type]
    assert "tokenwire:lora_requests_info" not in metric_samples(telemetry.exposition())
