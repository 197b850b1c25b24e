"""Embeddings over the wire: ``EmbeddingService.Embed`` on a real grpc.aio server (generated
stubs) and ``POST /v1/embeddings`` through the REST shim with the real ``openai`` SDK, for a
tiny random Qwen3 decoder embedding model (LAST pooling, Matryoshka) and a tiny random BERT
(MEAN pooling), both saved by sentence-transformers; vectors equal
``SentenceTransformer.encode`` (cosine >= 0.9999). Bad values are INVALID_ARGUMENT / 400
naming the field; a task mismatch is FAILED_PRECONDITION WRONG_TASK / 400; the engine is
idle with every KV block free after each test."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
from embed_models import build_st_model
from grpc_helpers import details_of
from rest_harness import RestHarness
from server_harness import MODEL_NAME, ServerHarness

from tokenwire.v1 import (
    common_pb2,
    embeddings_pb2,
    embeddings_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    models_pb2,
    models_pb2_grpc,
)

Code = grpc.StatusCode
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "paris is capital"]


def _cos(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


class Served:
    """A model dir, its sentence-transformers reference, a gRPC server and a REST shim."""

    def __init__(self, folder: Path, st: Any, **options: Any) -> None:
        self.st = st
        options.setdefault("in_process", True)
        self.harness = ServerHarness(folder, **options).start()
        self.rest = RestHarness(self.harness).start()
        self.channel = self.harness.channel()
        self.embed = embeddings_pb2_grpc.EmbeddingServiceStub(self.channel)
        self.client = openai.OpenAI(base_url=f"{self.rest.url}/v1", api_key="x", max_retries=0)

    def reference(self, texts: list[str]) -> np.ndarray:
        out: np.ndarray = self.st.encode(texts, convert_to_numpy=True)
        return out

    def stop(self) -> None:
        self.client.close()
        self.channel.close()
        self.rest.stop()
        self.harness.stop()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("api-qwen3")
    served = Served(folder, build_st_model("qwen3", folder, "lasttoken"), max_num_batched_tokens=8)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("api-bert")
    # The engine core in a process of its own (as ``tokenwire serve``): the pooled vectors
    # and the model's embedding facts cross the msgspec wire.
    st = build_st_model("bert", folder, "mean")
    served = Served(folder, st, max_model_len=128, in_process=False)
    yield served
    served.stop()


def expect(
    call: Callable[[], Any], code: grpc.StatusCode, reason: str | None = None
) -> tuple[grpc.RpcError, dict[str, str], str]:
    """A call that must fail with ``code``: (error, ErrorInfo metadata, ErrorInfo reason)."""
    with pytest.raises(grpc.RpcError) as caught:
        call()
    err = caught.value
    info, _ = details_of(err)
    assert err.code() == code, err.details()
    assert info is not None
    if reason is not None:
        assert info.reason == reason
    return err, dict(info.metadata), info.reason


def _texts(*texts: str, **fields: Any) -> embeddings_pb2.EmbedRequest:
    return embeddings_pb2.EmbedRequest(texts=embeddings_pb2.TextInputs(texts=texts), **fields)


# ---------------------------------------------------------------------------- gRPC
@pytest.mark.parametrize("name", ["qwen3", "bert"])
def test_grpc_embed_equals_sentence_transformers(name: str, request: pytest.FixtureRequest) -> None:
    served: Served = request.getfixturevalue(name)
    reference = served.reference(TEXTS)
    reply = served.embed.Embed(_texts(*TEXTS, request_id="emb-1"))
    assert reply.request_id == "emb-1" and reply.model == MODEL_NAME
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.dimensions == 64
    for ref, item in zip(reference, reply.data, strict=True):
        assert _cos(ref, item.values) >= 0.9999
    assert reply.usage.prompt_tokens == sum(d.prompt_tokens for d in reply.data) > 0
    # Token ids and little-endian float32 bytes: the same vectors.
    ids = [served.st.tokenizer(t)["input_ids"] for t in TEXTS]
    tokens = embeddings_pb2.TokenInputs(inputs=[common_pb2.TokenIds(ids=i) for i in ids])
    raw = served.embed.Embed(
        embeddings_pb2.EmbedRequest(tokens=tokens, encoding=embeddings_pb2.EMBEDDING_ENCODING_BYTES)
    )
    for ref, item in zip(reference, raw.data, strict=True):
        assert not item.values
        assert _cos(ref, np.frombuffer(item.data, dtype="<f4")) >= 0.9999
    served.harness.assert_idle()


def test_grpc_model_info_health_and_task_errors(qwen3: Served) -> None:
    models = models_pb2_grpc.ModelServiceStub(qwen3.channel)
    info = models.GetModelInfo(models_pb2.GetModelInfoRequest())
    assert (info.task, info.embedding_dimensions) == ("embed", 64)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(qwen3.channel)
    check = health_pb2.HealthCheckRequest(service="tokenwire.v1.EmbeddingService")
    assert health.Check(check).status == health_pb2.HealthCheckResponse.SERVING
    gen = generation_pb2_grpc.GenerationServiceStub(qwen3.channel)
    err, info_md, _ = expect(
        lambda: gen.Generate(generation_pb2.GenerateRequest(text="hello")),
        Code.FAILED_PRECONDITION,
        "WRONG_TASK",
    )
    assert "'embed'" in err.details() and info_md.get("task") == "embed"
    qwen3.harness.assert_idle()


def test_embed_on_a_generation_model_is_failed_precondition(
    tiny_model_factory: Callable[..., Path],
) -> None:
    harness = ServerHarness(tiny_model_factory("llama"), in_process=True).start()
    try:
        with harness.channel() as ch:
            stub = embeddings_pb2_grpc.EmbeddingServiceStub(ch)
            tokens = embeddings_pb2.TokenInputs(inputs=[common_pb2.TokenIds(ids=[1, 2, 3])])
            err, info, _ = expect(
                lambda: stub.Embed(embeddings_pb2.EmbedRequest(tokens=tokens)),
                Code.FAILED_PRECONDITION,
                "WRONG_TASK",
            )
            assert "'generate'" in err.details() and info.get("task") == "generate"
            info_reply = models_pb2_grpc.ModelServiceStub(ch).GetModelInfo(
                models_pb2.GetModelInfoRequest()
            )
            assert (info_reply.task, info_reply.embedding_dimensions) == ("generate", 0)
        harness.assert_idle()
    finally:
        harness.stop()


@pytest.mark.parametrize(
    ("build", "param", "code"),
    [
        (lambda: embeddings_pb2.EmbedRequest(), "input", Code.INVALID_ARGUMENT),
        (lambda: _texts(), "texts", Code.INVALID_ARGUMENT),
        (lambda: _texts("hello", ""), "texts", Code.INVALID_ARGUMENT),
        (lambda: _texts(*["a"] * 2049), "texts", Code.INVALID_ARGUMENT),
        (lambda: _texts("hello", dimensions=0), "dimensions", Code.INVALID_ARGUMENT),
        (lambda: _texts("hello", dimensions=-2), "dimensions", Code.INVALID_ARGUMENT),
        (lambda: _texts("hello", dimensions=65), "dimensions", Code.INVALID_ARGUMENT),
        (
            lambda: embeddings_pb2.EmbedRequest(
                tokens=embeddings_pb2.TokenInputs(inputs=[common_pb2.TokenIds(ids=[1] * 300)])
            ),
            "tokens",
            Code.INVALID_ARGUMENT,
        ),
        (
            lambda: embeddings_pb2.EmbedRequest(
                tokens=embeddings_pb2.TokenInputs(inputs=[common_pb2.TokenIds(ids=[10**6])])
            ),
            "tokens",
            Code.INVALID_ARGUMENT,
        ),
        (lambda: _texts("hello", model="nope"), "model", Code.NOT_FOUND),
    ],
)
def test_grpc_bad_values_name_the_field(
    qwen3: Served, build: Callable[[], embeddings_pb2.EmbedRequest], param: str, code: Code
) -> None:
    err, info, _ = expect(lambda: qwen3.embed.Embed(build()), code)
    assert param in err.details() or info.get("param") == param or info.get("model")
    if code == Code.INVALID_ARGUMENT:
        assert info.get("param") == param
    qwen3.harness.assert_idle()


def test_grpc_dimensions_on_a_model_without_matryoshka(bert: Served) -> None:
    err, info, _ = expect(
        lambda: bert.embed.Embed(_texts("hello", dimensions=8)), Code.INVALID_ARGUMENT
    )
    assert info.get("param") == "dimensions" and "Matryoshka" in err.details()
    bert.harness.assert_idle()


# ---------------------------------------------------------------------------- REST + SDK
@pytest.mark.parametrize("name", ["qwen3", "bert"])
def test_openai_sdk_single_batch_and_base64(name: str, request: pytest.FixtureRequest) -> None:
    served: Served = request.getfixturevalue(name)
    reference = served.reference(TEXTS)
    one = served.client.embeddings.create(model=MODEL_NAME, input=TEXTS[0])  # SDK: base64
    assert len(one.data) == 1 and _cos(reference[0], one.data[0].embedding) >= 0.9999
    batch = served.client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    for ref, item in zip(reference, batch.data, strict=True):
        assert _cos(ref, item.embedding) >= 0.9999
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > 0
    # Raw base64 as OpenAI sends it: little-endian float32.
    body = httpx.post(
        f"{served.rest.url}/v1/embeddings",
        json={"input": [TEXTS[1]], "encoding_format": "base64", "model": MODEL_NAME},
    ).json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert body["object"] == "list" and _cos(reference[1], vector) >= 0.9999
    ids = served.st.tokenizer(TEXTS[2])["input_ids"]
    tokens = served.client.embeddings.create(model=MODEL_NAME, input=[ids, ids])
    assert _cos(reference[2], tokens.data[1].embedding) >= 0.9999
    models = httpx.get(f"{served.rest.url}/v1/models").json()["data"]
    assert (models[0]["task"], models[0]["embedding_dimensions"]) == ("embed", 64)
    served.harness.assert_idle()


def test_openai_sdk_dimensions(qwen3: Served) -> None:
    full = qwen3.reference(TEXTS[:2])
    reply = qwen3.client.embeddings.create(model=MODEL_NAME, input=TEXTS[:2], dimensions=16)
    for ref, item in zip(full, reply.data, strict=True):
        assert len(item.embedding) == 16
        assert _cos(ref[:16], item.embedding) >= 0.9999
        assert abs(np.linalg.norm(item.embedding) - 1.0) < 1e-4  # renormalized
    qwen3.harness.assert_idle()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": "hi", "encoding_format": "bogus"}, "encoding_format"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "dimensions": 1000}, "dimensions"),
        ({"input": "hi", "dimensions": "8"}, "dimensions"),
        ({"input": ["a"] * 2049}, "input"),
        ({"input": [[1] * 300]}, "input"),
        ({"input": 5}, "input"),
        ({"input": "hi", "bogus": 1}, "bogus"),
    ],
)
def test_rest_bad_values_are_400_naming_the_field(
    qwen3: Served, body: dict[str, Any], param: str
) -> None:
    reply = httpx.post(f"{qwen3.rest.url}/v1/embeddings", json={"model": MODEL_NAME, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
    qwen3.harness.assert_idle()


def test_rest_task_mismatch_is_400_naming_the_task(qwen3: Served) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        qwen3.client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2)
    assert "task 'embed'" in str(info.value)
    qwen3.harness.assert_idle()


# ---------------------------------------------------------------------------- shared limits
def test_embed_shares_admission_limits_and_api_keys(tmp_path: Path) -> None:
    """``--max-requests`` counts every input of an Embed call (a batch over it is QUEUE_FULL
    with nothing left in the engine); the API key applies as to every RPC."""
    build_st_model("bert", tmp_path, "cls")
    harness = ServerHarness(
        tmp_path, in_process=True, max_model_len=128, max_requests=2, api_keys=("k1",)
    ).start()
    try:
        with harness.channel() as ch:
            stub = embeddings_pb2_grpc.EmbeddingServiceStub(ch)
            auth = (("authorization", "Bearer k1"),)
            expect(lambda: stub.Embed(_texts("hello")), Code.UNAUTHENTICATED, "API_KEY_INVALID")
            expect(
                lambda: stub.Embed(_texts("a", "b", "c"), metadata=auth),
                Code.RESOURCE_EXHAUSTED,
                "QUEUE_FULL",
            )
            harness.assert_idle()  # the inputs admitted before the refusal were aborted
            reply = stub.Embed(_texts("hello", "world"), metadata=auth)
            assert len(reply.data) == 2
        harness.assert_idle()
    finally:
        harness.stop()


def test_one_record_counts_every_input_of_an_embed_call() -> None:
    """The call's record waits for each input's engine record (``<id>#i``); the request
    counters then count every input, under the caller's tenant."""
    import time
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from tokenwire.runtime.engine.protocol import EngineStatsSnapshot
    from tokenwire.runtime.outputs import FinishReason
    from tokenwire.runtime.stats import RequestStats
    from tokenwire.server.telemetry.core import Telemetry

    telemetry = Telemetry()
    engine = SimpleNamespace(
        info=SimpleNamespace(served_model_name="m"),
        stats_snapshot=EngineStatsSnapshot,
        observer=telemetry,
    )
    telemetry.attach(engine)  # type: ignore[arg-type]
    record = telemetry.begin("e1", "tenant:alpha/e1", "embed")
    telemetry.set_tenant(record, "alpha")
    telemetry.admit(record, 2)
    t0 = time.monotonic()
    for i in range(2):
        stats = RequestStats(
            f"tenant:alpha/e1#{i}", t0, t0, t0 + 0.01, t0 + 0.01, 7, 0, 0, 0, FinishReason.LENGTH
        )
        telemetry.on_request_finished(stats)
    telemetry.end(record, "OK")
    samples = {
        (s.name, s.labels.get("tenant")): s.value
        for f in text_string_to_metric_families(telemetry.exposition().decode())
        for s in f.samples
    }
    assert samples[("tokenwire:request_success_total", "alpha")] == 2
    assert samples[("tokenwire:prompt_tokens_total", "alpha")] == 14
