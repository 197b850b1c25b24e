"""Cross-encoder scoring in the engine (offline ``LLM.score``): tiny random
``BertForSequenceClassification`` and ``XLMRobertaForSequenceClassification`` models;
tokenwire's scores equal transformers' forward + sigmoid within 1e-4 (float32), token types
included; pairing rules; wrong-task errors both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
from embed_models import build_st_model
from score_models import PAIRS, build_cross_encoder, reference_scores

from tokenwire.runtime.errors import ParameterError, WrongTaskError
from tokenwire.runtime.llm import LLM


@pytest.fixture(scope="module")
def ce_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


@pytest.fixture(scope="module")
def llm(ce_dir: Path) -> LLM:
    engine = LLM(str(ce_dir), kv_cache_memory=32 << 20)
    yield engine  # type: ignore[misc]
    engine.shutdown()


def test_scores_equal_transformers_forward_with_sigmoid(ce_dir: Path, llm: LLM) -> None:
    assert llm.engine.facts.task == "score"
    reference = reference_scores(ce_dir, PAIRS)
    outputs = llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS], use_tqdm=False)
    got = [o.outputs.score for o in outputs]
    assert got == pytest.approx(reference, abs=1e-4)
    assert max(reference) - min(reference) > 1e-3  # the pairs score apart (10x the tolerance)
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_second_text_runs_with_token_type_1(ce_dir: Path, llm: LLM) -> None:
    """The scores are those of the typed pair, clearly not those of an all-type-0 run."""
    got = [o.outputs.score for o in llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS])]
    untyped = reference_scores(ce_dir, PAIRS, zero_types=True)
    assert got == pytest.approx(reference_scores(ce_dir, PAIRS), abs=1e-4)
    assert max(abs(g - u) for g, u in zip(got, untyped, strict=True)) > 1e-2


def test_one_query_broadcasts_over_documents(ce_dir: Path, llm: LLM) -> None:
    query = PAIRS[0][0]
    docs = [b for _, b in PAIRS]
    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    assert got == pytest.approx(reference_scores(ce_dir, [(query, d) for d in docs]), abs=1e-4)


def test_xlm_roberta_scores_equal_transformers(tmp_path: Path) -> None:
    """XLM-R: positions offset past the padding index, one token type, its own head names."""
    folder = build_cross_encoder(tmp_path, seed=1, kind="xlm-roberta")
    reference = reference_scores(folder, PAIRS)
    with LLM(str(folder), kv_cache_memory=32 << 20) as llm:
        assert llm.engine.facts.task == "score"
        got = [o.outputs.score for o in llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS])]
        assert llm.engine.facts.max_model_len == 129  # 130 positions, 1 before the first
    assert got == pytest.approx(reference, abs=1e-4)
    assert max(reference) - min(reference) > 1e-3


def test_pairing_errors_name_the_field(llm: LLM) -> None:
    with pytest.raises(ParameterError) as err:
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    assert err.value.param == "text_2"
    with pytest.raises(ParameterError) as err:
        llm.score([], ["c"], use_tqdm=False)
    assert err.value.param == "text_1"


def test_embed_and_generate_on_a_cross_encoder_are_wrong_task(llm: LLM) -> None:
    with pytest.raises(WrongTaskError) as err:
        llm.embed(["hello world"], use_tqdm=False)
    assert err.value.task == "score"


def test_score_on_an_embedding_model_is_wrong_task(tmp_path: Path) -> None:
    build_st_model("bert", tmp_path, "cls")
    with LLM(str(tmp_path), kv_cache_memory=32 << 20) as llm:
        with pytest.raises(WrongTaskError) as err:
            llm.score("hello", "world", use_tqdm=False)
        assert err.value.task == "embed"


def test_task_flag_checks(ce_dir: Path) -> None:
    with pytest.raises(ValueError, match="--task score"):
        LLM(str(ce_dir), task="embed", kv_cache_memory=32 << 20)
