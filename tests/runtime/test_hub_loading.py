"""Hugging Face hub ids as the model / tokenizer argument, resolved from a local HF cache that
the test lays out itself (``models--ORG--NAME/snapshots/<commit>/``, ``refs/<name>``), with
``HF_HUB_OFFLINE=1``: no network. ``--revision`` picks a snapshot by commit or tag,
``--download-dir`` / ``HF_HUB_CACHE`` / ``HF_HOME`` say where the cache is, and a missing id
is a startup error that names the argument (no traceback)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.hub import hub_cache_dir, looks_like_hub_id
from tokenwire.runtime.sampling_params import SamplingParams

COMMIT_1 = "1" * 40
COMMIT_2 = "2" * 40
REPO = "test-org/tiny-llama"
PROMPT = [5, 17, 99, 230, 7]
# A small KV cache: allocating the default 2 GiB costs seconds per engine.
SMALL: dict[str, Any] = {"device": "cpu", "num_gpu_blocks_override": 64}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def add_snapshot(cache: Path, repo_id: str, commit: str, source: Path, *refs: str) -> Path:
    """Lay ``source``'s files out as the HF cache does: a snapshot folder named by the commit
    and ``refs/<name>`` files holding it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_factory: Callable[..., Path]
) -> Path:
    """main -> a tiny llama (context 512); tag v2 -> another one (context 384)."""
    cache = tmp_path_factory.mktemp("hf-cache")
    add_snapshot(cache, REPO, COMMIT_1, tiny_model_factory("llama"), "main")
    second = tiny_model_factory("llama", max_position_embeddings=384)
    add_snapshot(cache, REPO, COMMIT_2, second, "v2")
    return cache


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-default-cache"))


def test_hub_id_shape() -> None:
    assert looks_like_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    for not_an_id in ("gpt2", "./org/name", "/abs/path", "a/b/c", "~/x", "org/..", "a--b/c"):
        assert not looks_like_hub_id(not_an_id), not_an_id


def test_cache_dir_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", "/hub-cache")
    monkeypatch.setenv("HF_HOME", "/hf-home")
    assert hub_cache_dir("/download-dir") == Path("/download-dir")
    assert hub_cache_dir(None) == Path("/hub-cache")
    monkeypatch.delenv("HF_HUB_CACHE")
    assert hub_cache_dir(None) == Path("/hf-home/hub")


def test_hub_id_loads_the_main_snapshot(
    hub_cache: Path, tiny_model_factory: Callable[..., Path]
) -> None:
    llm = LLM(REPO, download_dir=str(hub_cache), **SMALL)
    facts = llm.engine.facts
    assert (
        Path(facts.model_path) == hub_cache / f"models--test-org--tiny-llama/snapshots/{COMMIT_1}"
    )
    assert facts.served_model_name == REPO  # served under the id, as vLLM does
    assert facts.max_model_len == 512
    local = LLM(str(tiny_model_factory("llama")), **SMALL)
    ours = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == local.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("revision", ["v2", COMMIT_2])
def test_revision_picks_the_second_snapshot(hub_cache: Path, revision: str) -> None:
    llm = LLM(REPO, revision=revision, download_dir=str(hub_cache), **SMALL)
    assert Path(llm.engine.facts.model_path).name == COMMIT_2
    assert llm.engine.facts.max_model_len == 384


def test_hf_hub_cache_and_hf_home_are_honoured(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    assert Path(LLM(REPO, **SMALL).engine.facts.model_path).name == COMMIT_1
    monkeypatch.delenv("HF_HUB_CACHE")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "hub").symlink_to(hub_cache)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert Path(LLM(REPO, **SMALL).engine.facts.model_path).name == COMMIT_1


def test_tokenizer_hub_id(
    hub_cache: Path, tiny_model_with_tokenizer: Path, tiny_model_factory: Callable[..., Path]
) -> None:
    tokenizer_files = hub_cache.parent / "tokenizer-only"
    if not tokenizer_files.exists():
        tokenizer_files.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tiny_model_with_tokenizer / name).is_file():
                shutil.copy(tiny_model_with_tokenizer / name, tokenizer_files / name)
        add_snapshot(hub_cache, "test-org/tok", COMMIT_1, tokenizer_files, "main")
    model = tiny_model_factory("llama")  # no tokenizer of its own
    assert LLM(str(model), **SMALL).tokenizer is None
    llm = LLM(str(model), tokenizer="test-org/tok", download_dir=str(hub_cache), **SMALL)
    assert llm.engine.facts.tokenizer_path is not None
    assert Path(llm.engine.facts.tokenizer_path).parent.parent.name == "models--test-org--tok"
    assert llm.tokenizer is not None and llm.tokenizer("Hello")["input_ids"]


def test_missing_id_is_an_error_naming_the_model(hub_cache: Path) -> None:
    with pytest.raises(ValueError, match=r"^model: 'test-org/absent' does not exist") as err:
        LLM("test-org/absent", download_dir=str(hub_cache), **SMALL)
    assert "neither a local path nor in the Hugging Face cache" in str(err.value)
    assert str(hub_cache) in str(err.value) and "HF_HUB_OFFLINE=1" in str(err.value)
    with pytest.raises(ValueError, match=r"revision 'v9'"):
        LLM(REPO, revision="v9", download_dir=str(hub_cache), **SMALL)
    with pytest.raises(ValueError, match=r"^tokenizer: 'test-org/no-tok' does not exist"):
        LLM(REPO, tokenizer="test-org/no-tok", download_dir=str(hub_cache), **SMALL)


def test_serve_reports_a_missing_id_without_a_traceback(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenwire.server.cli import main

    argv = ["serve", "test-org/absent", "--download-dir", str(hub_cache), "--engine-in-process"]
    assert main([*argv, "--grpc-port", "0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert (
        "tokenwire: error: model: 'test-org/absent' does not exist: it is neither a local " in err
    )
    assert "Traceback" not in err
