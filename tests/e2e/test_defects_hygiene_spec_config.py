"""Every malformed ``--speculative-config`` (defects issue, item 14) is a startup error
naming the flag in one line, without traceback: not JSON, not an object, an unknown method or
key, a missing / non-positive / non-integer count, wrong types, prompt-lookup bounds, and a
draft model that is missing, not a model, unreadable or of another vocabulary. Checked
through ``tokenwire generate`` and ``tokenwire serve`` (argument parsing in-process, draft
loading in real processes, before readiness) and ``LLM(**kwargs)`` (a ValueError)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tokenwire.runtime.llm import LLM
from tokenwire.server.cli import main

FLAG = "--speculative-config"
NO_MODEL = "/nonexistent/model"
K = {"num_speculative_tokens": 2}
MALFORMED: dict[str, Any] = {
    "array": [1, 2],
    "string": "ngram",
    "number": 4,
    "unknown method": {"method": "eagle", **K},
    "method of another type": {"method": 5, **K},
    "missing num_speculative_tokens": {"method": "ngram"},
    "negative num_speculative_tokens": {"method": "ngram", "num_speculative_tokens": -1},
    "float num_speculative_tokens": {"method": "ngram", "num_speculative_tokens": 2.5},
    "string num_speculative_tokens": {"method": "ngram", "num_speculative_tokens": "4"},
    "bool num_speculative_tokens": {"method": "ngram", "num_speculative_tokens": True},
    "null num_speculative_tokens": {"method": "ngram", "num_speculative_tokens": None},
    "unknown key": {"method": "ngram", **K, "foo": 1},
    "string prompt_lookup_min": {"method": "ngram", **K, "prompt_lookup_min": "2"},
    "zero prompt_lookup_min": {"method": "ngram", **K, "prompt_lookup_min": 0},
    "prompt_lookup_max below min": {
        "method": "ngram",
        **K,
        "prompt_lookup_min": 3,
        "prompt_lookup_max": 2,
    },
    "float prompt_lookup_max": {"method": "ngram", **K, "prompt_lookup_max": 4.5},
    "null prompt_lookup_max": {"method": "ngram", **K, "prompt_lookup_max": None},
    "float disable_by_batch_size": {"method": "ngram", **K, "disable_by_batch_size": 1.5},
    "model with ngram": {"method": "ngram", **K, "model": "x"},
    "draft_model without model": {"method": "draft_model", **K},
    "draft model of another type": {"method": "draft_model", **K, "model": 5},
}


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, stderr
    assert FLAG in errors[0], errors[0]
    assert "not supported between" not in errors[0], errors[0]  # Python's words, not ours
    return errors[0]


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("name", ["not JSON", *MALFORMED])
def test_cli_refuses_the_config_naming_the_flag(
    command: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "{bad" if name == "not JSON" else json.dumps(MALFORMED[name])
    # A model that does not exist: were the config accepted, the command fails fast anyway.
    argv = ["generate", "hi", "--model", NO_MODEL]
    if command == "serve":
        argv = ["serve", NO_MODEL, "--grpc-port", "0", "--port", "0"]
    with pytest.raises(SystemExit) as caught:
        main([*argv, FLAG, text])
    assert caught.value.code == 2
    _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("name", ["not JSON", *MALFORMED])
def test_llm_kwargs_raise_a_value_error_naming_the_flag(name: str) -> None:
    value = "{bad" if name == "not JSON" else MALFORMED[name]
    with pytest.raises(ValueError, match=FLAG) as caught:
        LLM(NO_MODEL, speculative_config=value)
    assert "\n" not in str(caught.value)
    assert "not supported between" not in str(caught.value)


def _drafts(target: Path, tmp_path: Path, other_vocab: Path) -> dict[str, str]:
    """Draft model paths that cannot serve as the target's draft."""
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "config.json").write_text("{}")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(target, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\xff" * 1000)
    empty = tmp_path / "empty"
    empty.mkdir()
    return {
        "missing": str(tmp_path / "nowhere"),
        "a file": str(target / "config.json"),
        "no config.json": str(empty),
        "not a model": str(not_a_model),
        "unreadable weights": str(corrupt),
        "another vocabulary": str(other_vocab),
    }


def _draft_config(path: str) -> dict[str, Any]:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": 2}


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
    assert exe is not None
    env = dict(os.environ, PYTHONSAFEPATH="1")
    return subprocess.run(
        [exe, *argv], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def test_bad_draft_models_fail_startup_naming_the_flag(
    tiny_model_with_tokenizer: Path,
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
) -> None:
    target = tiny_model_with_tokenizer
    drafts = _drafts(target, tmp_path, tiny_model_factory("llama", vocab_size=300))
    for name, path in drafts.items():
        with pytest.raises(ValueError, match=f"{FLAG} model") as caught:
            LLM(str(target), device="cpu", speculative_config=_draft_config(path))
        assert "\n" not in str(caught.value), name
    # The command line, in real processes (serve: the engine core in a process of its own).
    for name in ("missing", "unreadable weights", "not a model"):
        text = json.dumps(_draft_config(drafts[name]))
        for argv in (
            ["generate", "hi", "--model", str(target), "--max-tokens", "2"],
            ["serve", str(target), "--grpc-port", "0", "--port", "0", "--log-format", "json"],
        ):
            done = _run(*argv, FLAG, text)
            assert done.returncode != 0, (name, argv[0])
            line = _one_error_line(done.stderr)
            assert f"{FLAG} model" in line, line
            assert "serving model=" not in done.stdout  # it never became ready
