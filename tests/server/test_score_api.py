"""Cross-encoder scoring over the wire: ``EmbeddingService.Score`` on a real grpc.aio server
(generated stubs; the engine core in its own process, so ``pair_start`` crosses the msgspec
wire) and ``POST /v1/score``, ``/v1/rerank``, ``/v2/rerank`` through the REST shim over real
HTTP (httpx), for a tiny random ``BertForSequenceClassification``; scores equal
transformers' forward + sigmoid within 1e-4. Bad values are INVALID_ARGUMENT / 400 naming
the field; task mismatches are FAILED_PRECONDITION WRONG_TASK; API keys apply; the engine
is idle with every KV block free after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from embed_models import build_st_model
from grpc_helpers import details_of
from rest_harness import RestHarness
from score_models import PAIRS, build_cross_encoder, reference_scores
from server_harness import MODEL_NAME, ServerHarness

from tokenwire.runtime.front.score_pairs import MAX_SCORE_PAIRS
from tokenwire.v1 import embeddings_pb2, embeddings_pb2_grpc, models_pb2, models_pb2_grpc

Code = grpc.StatusCode
QUERY = PAIRS[0][0]
DOCS = [b for _, b in PAIRS]


class Served:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.harness = ServerHarness(folder, max_model_len=128, in_process=False).start()
        self.rest = RestHarness(self.harness).start()
        self.channel = self.harness.channel()
        self.stub = embeddings_pb2_grpc.EmbeddingServiceStub(self.channel)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.rest.url}{path}", json={"model": MODEL_NAME, **body})

    def stop(self) -> None:
        self.channel.close()
        self.rest.stop()
        self.harness.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    out = Served(build_cross_encoder(tmp_path_factory.mktemp("api-cross-encoder")))
    yield out
    out.stop()


def expect(call: Callable[[], Any], code: grpc.StatusCode) -> dict[str, str]:
    """A call that must fail with ``code``: its ErrorInfo metadata (with the reason)."""
    with pytest.raises(grpc.RpcError) as caught:
        call()
    info, _ = details_of(caught.value)
    assert caught.value.code() == code, caught.value.details()
    assert info is not None
    return {**info.metadata, "reason": info.reason}


def _req(text_1: list[str], text_2: list[str], **fields: Any) -> embeddings_pb2.ScoreRequest:
    return embeddings_pb2.ScoreRequest(text_1=text_1, text_2=text_2, **fields)


# ---------------------------------------------------------------------------- gRPC
def test_grpc_score_equals_transformers(served: Served) -> None:
    reference = reference_scores(served.folder, PAIRS)
    reply = served.stub.Score(_req([a for a, _ in PAIRS], DOCS, request_id="score-1"), timeout=120)
    assert reply.request_id == "score-1" and reply.model == MODEL_NAME
    assert [d.index for d in reply.data] == [0, 1, 2, 3]
    assert [d.score for d in reply.data] == pytest.approx(reference, abs=1e-4)
    assert reply.usage.prompt_tokens == sum(d.prompt_tokens for d in reply.data) > 0
    one = served.stub.Score(_req([QUERY], DOCS), timeout=120)  # one text_1, broadcast
    expected = reference_scores(served.folder, [(QUERY, d) for d in DOCS])
    assert [d.score for d in one.data] == pytest.approx(expected, abs=1e-4)
    info = models_pb2_grpc.ModelServiceStub(served.channel).GetModelInfo(
        models_pb2.GetModelInfoRequest()
    )
    assert info.task == "score"
    served.harness.assert_idle()


@pytest.mark.parametrize(
    ("text_1", "text_2", "param"),
    [
        ([], ["a"], "text_1"),
        (["a"], [], "text_2"),
        (["a", "b"], ["c", "d", "e"], "text_2"),
        (["a"], ["b"] * (MAX_SCORE_PAIRS + 1), "text_2"),
        (["a"], ["the quick brown fox " * 40], "text_2"),  # longer than the context
    ],
)
def test_grpc_bad_values_name_the_field(
    served: Served, text_1: list[str], text_2: list[str], param: str
) -> None:
    info = expect(lambda: served.stub.Score(_req(text_1, text_2)), Code.INVALID_ARGUMENT)
    assert info.get("param") == param
    served.harness.assert_idle()


def test_grpc_embed_on_a_cross_encoder_is_wrong_task(served: Served) -> None:
    texts = embeddings_pb2.TextInputs(texts=["hello"])
    info = expect(
        lambda: served.stub.Embed(embeddings_pb2.EmbedRequest(texts=texts)),
        Code.FAILED_PRECONDITION,
    )
    assert (info["reason"], info.get("task")) == ("WRONG_TASK", "score")


def test_score_on_an_embedding_model_and_api_keys(tmp_path: Path) -> None:
    build_st_model("bert", tmp_path, "cls")
    harness = ServerHarness(tmp_path, in_process=True, max_model_len=128, api_keys=("k1",))
    harness.start()
    try:
        with harness.channel() as ch:
            stub = embeddings_pb2_grpc.EmbeddingServiceStub(ch)
            info = expect(lambda: stub.Score(_req(["a"], ["b"])), Code.UNAUTHENTICATED)
            assert info["reason"] == "API_KEY_INVALID"
            auth = (("authorization", "Bearer k1"),)
            info = expect(
                lambda: stub.Score(_req(["a"], ["b"]), metadata=auth), Code.FAILED_PRECONDITION
            )
            assert (info["reason"], info.get("task")) == ("WRONG_TASK", "embed")
        harness.assert_idle()
    finally:
        harness.stop()


# ---------------------------------------------------------------------------- REST
def test_rest_score(served: Served) -> None:
    reply = served.post("/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == MODEL_NAME
    assert body["id"] == f"score-{reply.headers['x-request-id']}"
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert {d["object"] for d in body["data"]} == {"score"}
    expected = reference_scores(served.folder, [(QUERY, d) for d in DOCS])
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-4)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    served.harness.assert_idle()


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_rest_rerank_sorted_top_n_and_documents(served: Served, path: str) -> None:
    expected = reference_scores(served.folder, [(QUERY, d) for d in DOCS])
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    reply = served.post(path, {"query": QUERY, "documents": DOCS})
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["index"] for r in results] == order
    assert [r["relevance_score"] for r in results] == pytest.approx(
        [expected[i] for i in order], abs=1e-4
    )
    assert [r["document"]["text"] for r in results] == [DOCS[i] for i in order]
    top = served.post(path, {"query": QUERY, "documents": DOCS, "top_n": 2}).json()
    assert [r["index"] for r in top["results"]] == order[:2]
    bare = served.post(
        path, {"query": QUERY, "documents": DOCS, "top_n": 1, "return_documents": False}
    ).json()
    assert [set(r) for r in bare["results"]] == [{"index", "relevance_score"}]
    assert bare["usage"]["total_tokens"] > 0
    served.harness.assert_idle()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
        ("/v2/rerank", {"documents": DOCS}, "query"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("/v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "bogus": 1}, "bogus"),
    ],
)
def test_rest_bad_values_are_400_naming_the_field(
    served: Served, path: str, body: dict[str, Any], param: str
) -> None:
    reply = served.post(path, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
    served.harness.assert_idle()
