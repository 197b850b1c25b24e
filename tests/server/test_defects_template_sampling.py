"""Defects #18: no invented sampling defaults. The default model's built-in default is greedy
and nothing else (no repetition_penalty: under it "Alice is 30" came back as age 25), and a
default penalty from a model's own files never applies to constrained decoding (a structured
output, a required / named tool choice) unless the request sets one."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from rest_harness import RestHarness
from server_harness import MODEL_NAME, ServerHarness

from tokenwire.clients.client import Client
from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.loader.generation_config import default_sampling
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.server.grpc.convert import Limits, sampling_params
from tokenwire.v1 import common_pb2

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
FILE_DEFAULTS = {"temperature": 0.0, "repetition_penalty": 1.05}


def test_the_default_model_defaults_are_greedy_only(tmp_path: Path) -> None:
    assert default_sampling(ModelConfig(), tmp_path, None) == {"temperature": 0.0}


@pytest.mark.parametrize(
    ("output", "sampling", "expected"),
    [
        (common_pb2.OutputOptions(), common_pb2.SamplingOptions(), 1.05),
        (
            common_pb2.OutputOptions(structured_output=common_pb2.StructuredOutput(regex="a+")),
            common_pb2.SamplingOptions(),
            1.0,
        ),
        (
            common_pb2.OutputOptions(structured_output=common_pb2.StructuredOutput(regex="a+")),
            common_pb2.SamplingOptions(repetition_penalty=1.2),
            1.2,
        ),
    ],
)
def test_structured_output_gets_no_default_penalty(
    output: common_pb2.OutputOptions, sampling: common_pb2.SamplingOptions, expected: float
) -> None:
    params = sampling_params(
        sampling, common_pb2.StoppingOptions(), output, Limits(), FILE_DEFAULTS
    )
    assert params.repetition_penalty == pytest.approx(expected)
    assert params.temperature == 0.0  # the other defaults still apply


@pytest.fixture(scope="module")
def penalised(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_with_tokenizer: Path
) -> Iterator[ServerHarness]:
    """The tiny model with a generation_config.json that sets a repetition penalty."""
    folder = tmp_path_factory.mktemp("penalised") / "model"
    shutil.copytree(tiny_model_with_tokenizer, folder)
    (folder / "generation_config.json").write_text(json.dumps(FILE_DEFAULTS))
    h = ServerHarness(folder, in_process=True, num_blocks=64).start()
    yield h
    h.stop()


def _recorded(harness: ServerHarness, monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    """Every SamplingParams the gRPC service hands the engine (the call goes through)."""
    seen: list[SamplingParams] = []
    add_request = harness.engine.add_request

    def record(*args: Any, **kwargs: Any) -> Any:
        seen.append(args[3])
        return add_request(*args, **kwargs)

    monkeypatch.setattr(harness.engine, "add_request", record)
    return seen


def test_tool_choice_grammars_get_no_default_penalty(
    penalised: ServerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _recorded(penalised, monkeypatch)
    rest = RestHarness(penalised).start()
    tool = {"type": "function", "function": {"name": "f", "parameters": PERSON}}
    ask = [{"role": "user", "content": "Alice is 30."}]
    try:
        with openai.OpenAI(base_url=f"{rest.url}/v1", api_key="x", max_retries=0) as sdk:
            for choice in ("required", {"type": "function", "function": {"name": "f"}}):
                sdk.chat.completions.create(
                    model=MODEL_NAME, messages=ask, tools=[tool], tool_choice=choice, max_tokens=4
                )  # type: ignore[call-overload]
            sdk.chat.completions.create(model=MODEL_NAME, messages=ask, max_tokens=4)
    finally:
        rest.stop()
    assert [p.repetition_penalty for p in seen] == [1.0, 1.0, pytest.approx(1.05)]
    penalised.assert_idle()


@pytest.mark.slow
def test_default_model_copies_from_the_prompt_under_a_schema() -> None:
    """The issue's case, served, no sampling field set: greedy extraction keeps the facts."""
    harness = ServerHarness(None, in_process=True, num_blocks=64).start()
    try:
        rest = RestHarness(harness).start()
        fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        try:
            with openai.OpenAI(base_url=f"{rest.url}/v1", api_key="x", max_retries=0) as sdk:
                reply = sdk.chat.completions.create(
                    model=MODEL_NAME,
                    messages=[
                        {
                            "role": "user",
                            "content": "Alice is 30. Extract the person's name and age as JSON.",
                        }
                    ],
                    response_format=fmt,
                    max_tokens=64,
                )
                fox = sdk.chat.completions.create(
                    model=MODEL_NAME,
                    messages=[
                        {
                            "role": "user",
                            "content": "Repeat exactly: The quick brown fox jumps over the lazy "
                            "dog.",
                        }
                    ],
                    max_tokens=32,
                )
        finally:
            rest.stop()
        assert json.loads(reply.choices[0].message.content or "") == {"name": "Alice", "age": 30}
        assert "The quick brown fox jumps over the lazy dog." in (
            fox.choices[0].message.content or ""
        )
        with Client(harness.target, timeout=120) as client:
            info = client.model_info()
        assert not info.default_sampling.HasField("repetition_penalty")
        assert not info.default_sampling.HasField("top_p")
        assert info.default_sampling.temperature == 0.0
        harness.assert_idle()
    finally:
        harness.stop()
