"""Embeddings in the engine (offline ``LLM.embed``): tiny random decoder (Qwen3) and BERT
models saved by sentence-transformers itself; tokenwire's vectors equal
``SentenceTransformer.encode`` (cosine >= 0.9999) for LAST / MEAN / CLS pooling, with
chunked prefill (MEAN exact across chunks, also after a preemption restart); Matryoshka
``dimensions``;
wrong-task errors; every KV block free afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from embed_models import build_st_model

from tokenwire.runtime.errors import ContextLengthError, ParameterError, WrongTaskError
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.pooling_params import PoolerConfig, parse_pooler_config

TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog and what where when why how many",
    "paris is the capital of france",
    "retrieval augmented generation needs good embeddings for every query and document",
]
_ST_MODE = {"LAST": "lasttoken", "MEAN": "mean", "CLS": "cls"}


def _cos(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("st-qwen3")
    build_st_model("qwen3", out, "lasttoken")
    return out


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("st-bert")
    build_st_model("bert", out, "mean")
    return out


def _reference(folder: Path, pooling: str, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    st = SentenceTransformer(str(folder), device="cpu")
    if _ST_MODE[pooling] != st[1].pooling_mode:  # the same weights, another pooling
        dim = st[0].get_embedding_dimension()
        st = SentenceTransformer(
            modules=[st[0], models.Pooling(dim, pooling_mode=_ST_MODE[pooling]), st[2]],
            device="cpu",
        )
    out: np.ndarray = st.encode(texts, convert_to_numpy=True)
    return out


def _assert_all_free(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_decoder_embeddings_equal_sentence_transformers_with_chunked_prefill(
    qwen3_dir: Path, pooling: str
) -> None:
    reference = _reference(qwen3_dir, pooling, TEXTS)
    # 8-token steps: every longer input runs over several chunks (MEAN sums across them).
    config = {"pooling_type": pooling} if pooling != "LAST" else None
    with LLM(
        str(qwen3_dir), max_num_batched_tokens=8, kv_cache_memory=32 << 20, pooler_config=config
    ) as llm:
        assert llm.engine.facts.embed is not None
        assert llm.engine.facts.embed.pooler.pooling_type == pooling
        out = llm.embed(TEXTS, use_tqdm=False)
        assert max(len(o.prompt_token_ids) for o in out) > 16  # really chunked
        if pooling != "CLS":  # a causal model's first token sees only itself
            assert _cos(out[0].outputs.embedding, out[1].outputs.embedding) < 0.99
        for ref, got in zip(reference, out, strict=True):
            assert len(got.outputs.embedding) == 64
            assert _cos(ref, got.outputs.embedding) >= 0.9999
            assert abs(np.linalg.norm(got.outputs.embedding) - 1.0) < 1e-5  # Normalize module
        _assert_all_free(llm)


def test_pooler_chunks_are_exact_and_a_preempted_request_restarts() -> None:
    """MEAN over chunks equals MEAN over the whole prompt; a request preempted mid-prefill
    (the runner calls ``forget``) restarts from position 0 without its old partial sum."""
    import torch

    from tokenwire.runtime.pooling_params import PoolingParams, ResolvedPooler
    from tokenwire.runtime.worker.pooler import Pooler

    hidden = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    want = torch.nn.functional.normalize(hidden.mean(0), dim=0)
    pooler = Pooler(ResolvedPooler("MEAN", True))
    params = [PoolingParams()]

    def run(start: int, end: int, done: bool) -> dict[str, list[float]]:
        return pooler.step(
            ["r"],
            params,
            np.array([0]),
            np.array([end - start]),
            np.array([done]),
            np.array([10]),
            hidden[start:end],
        )

    assert run(0, 4, False) == {}
    pooler.forget("r")  # preempted: recomputed from scratch
    assert run(0, 3, False) == {} and run(3, 7, False) == {}
    got = run(7, 10, True)["r"]
    assert torch.allclose(torch.tensor(got), want, atol=1e-6)
    assert pooler._partial == {}  # nothing kept after the request finished


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_bert_embeddings_equal_sentence_transformers(bert_dir: Path, pooling: str) -> None:
    reference = _reference(bert_dir, pooling, TEXTS)
    config = None if pooling == "MEAN" else {"pooling_type": pooling}
    with LLM(str(bert_dir), kv_cache_memory=32 << 20, pooler_config=config) as llm:
        assert llm.engine.facts.encoder and llm.engine.facts.task == "embed"
        out = llm.embed(TEXTS, use_tqdm=False)
        for ref, got in zip(reference, out, strict=True):
            assert _cos(ref, got.outputs.embedding) >= 0.9999
        ids = [o.prompt_token_ids for o in out]  # token-id input: the same vectors
        again = llm.embed(ids, use_tqdm=False)
        for a, b in zip(out, again, strict=True):
            assert _cos(a.outputs.embedding, b.outputs.embedding) >= 0.99999
        _assert_all_free(llm)


def test_matryoshka_dimensions_and_errors(qwen3_dir: Path, bert_dir: Path) -> None:
    full = _reference(qwen3_dir, "LAST", TEXTS[:2])
    with LLM(str(qwen3_dir), kv_cache_memory=32 << 20) as llm:
        out = llm.embed(TEXTS[:2], dimensions=16, use_tqdm=False)
        for ref, got in zip(full, out, strict=True):
            cut = ref[:16] / np.linalg.norm(ref[:16])  # the prefix, renormalized
            assert len(got.outputs.embedding) == 16
            assert _cos(cut, got.outputs.embedding) >= 0.9999
        for bad in (0, -3, 65):
            with pytest.raises(ParameterError) as info:
                llm.embed(["hello"], dimensions=bad, use_tqdm=False)
            assert info.value.param == "dimensions"
        with pytest.raises(ContextLengthError) as too_long:
            llm.embed([[5] * 300], use_tqdm=False)  # max_model_len 256
        assert too_long.value.param == "input"
        with pytest.raises(WrongTaskError, match="serves task 'embed'"):
            llm.generate(["hello"], use_tqdm=False)
        _assert_all_free(llm)
    bert = LLM(str(bert_dir), kv_cache_memory=32 << 20)  # not Matryoshka-capable
    with bert, pytest.raises(ParameterError, match="Matryoshka"):
        bert.embed(["hello"], dimensions=8, use_tqdm=False)


def test_embed_on_a_generation_model_names_its_task(tiny_model_factory: Any) -> None:
    with LLM(str(tiny_model_factory("llama")), kv_cache_memory=32 << 20) as llm:
        assert llm.engine.facts.task == "generate"
        with pytest.raises(WrongTaskError, match="serves task 'generate'"):
            llm.embed([[1, 2, 3]], use_tqdm=False)


def test_pooler_config_flag_values() -> None:
    assert parse_pooler_config('{"pooling_type": "mean", "normalize": false}') == PoolerConfig(
        "MEAN", False
    )
    for bad in ('{"pooling_type": "MAX"}', '{"normalize": 1}', '{"pool": "LAST"}', "[1]", "{"):
        with pytest.raises(ValueError, match="pooler_config"):
            parse_pooler_config(bad)
    with pytest.raises(ValueError, match="task"):
        LLM("unused", task="classify")
