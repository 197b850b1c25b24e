"""``VllmEngine.Embed`` (the vLLM engine protocol a gateway sends ``/v1/embeddings`` over):
a tokenized input's vector equals sentence-transformers', a bad input is INVALID_ARGUMENT
naming the proto field, a generation model answers FAILED_PRECONDITION / WRONG_TASK, and the
engine ends idle with every KV block free (issue 41, item 5)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from embed_models import build_st_model
from grpc_helpers import details_of
from server_harness import ServerHarness
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

pb = vllm_engine_pb2
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerHarness, Any]]:
    folder = tmp_path_factory.mktemp("worker-embed")
    st = build_st_model("qwen3", folder, "lasttoken")
    harness = ServerHarness(folder, in_process=True, worker_protocol="vllm").start()
    yield harness, st
    harness.stop()


def _cos(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_worker_embed_equals_sentence_transformers(served: tuple[ServerHarness, Any]) -> None:
    harness, st = served
    reference = st.encode(TEXTS, convert_to_numpy=True)
    with harness.channel() as ch:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        for i, (text, ref) in enumerate(zip(TEXTS, reference, strict=True)):
            ids = st.tokenizer(text)["input_ids"]
            reply = stub.Embed(
                pb.EmbedRequest(request_id=f"e{i}", tokenized=pb.TokenizedInput(input_ids=ids))
            )
            assert reply.embedding_dim == len(reply.embedding) == 64
            assert reply.prompt_tokens == len(ids)
            assert _cos(ref, reply.embedding) >= 0.9999
        with pytest.raises(grpc.RpcError) as caught:
            stub.Embed(pb.EmbedRequest(request_id="empty", tokenized=pb.TokenizedInput()))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        info, _ = details_of(caught.value)
        assert info is not None and "tokenized.input_ids" in (caught.value.details() or "")
    harness.assert_idle()


def test_worker_embed_on_a_generation_model_is_wrong_task(
    tiny_model_factory: Callable[..., Path],
) -> None:
    harness = ServerHarness(
        tiny_model_factory("llama"), in_process=True, worker_protocol="vllm"
    ).start()
    try:
        with harness.channel() as ch:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
            request = pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]))
            with pytest.raises(grpc.RpcError) as caught:
                stub.Embed(request)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            info, _ = details_of(caught.value)
            assert info is not None and info.reason == "WRONG_TASK"
        harness.assert_idle()
    finally:
        harness.stop()
