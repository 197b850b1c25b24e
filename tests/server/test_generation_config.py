"""``--generation-config`` (default sampling parameters from the model's generation_config.json)
and ``--chat-template``, end to end: the defaults apply to the fields a request leaves unset on
gRPC (unary and Session, i.e. ``tokenwire chat``), REST and ``LLM.generate(None)``, a request
overrides them field by field, ``vllm`` ignores them, GetModelInfo shows them; the template
replaces the tokenizer's on gRPC chat, the OpenAI shim and ``LLM.chat``. A slow test checks the
default model's built-in default (greedy) answers a plain request sensibly."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import httpx
import pytest
from rest_harness import RestHarness
from server_harness import ServerHarness

from tokenwire.clients.chat import run_chat
from tokenwire.clients.client import Client
from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.default_model import DEFAULT_MODEL_SAMPLING
from tokenwire.runtime.loader.generation_config import default_sampling, from_gguf
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.v1 import models_pb2

# A model card's generation_config.json (Qwen3-style), with keys tokenwire must not read.
GENERATION = {
    "bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True,
    "temperature": 0.0, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 6,
}  # fmt: skip
DEFAULTS = {"temperature": 0.0, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 6}
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
# A small KV cache: allocating the default 2 GiB costs seconds per engine.
SMALL: dict[str, Any] = {"device": "cpu", "num_gpu_blocks_override": 64}
HELLO = [{"role": "user", "content": "Hello there"}]
RENDERED = "[user] Hello there\n[assistant]"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_with_tokenizer: Path) -> Path:
    """The tiny llama with a tokenizer, plus GENERATION as its generation_config.json."""
    out = tmp_path_factory.mktemp("gen-config") / "model"
    shutil.copytree(tiny_model_with_tokenizer, out)
    (out / "generation_config.json").write_text(json.dumps(GENERATION))
    return out


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory: Any) -> Path:
    """A tiny llama without a tokenizer (loads fastest), with GENERATION."""
    out = tmp_path_factory.mktemp("gen-config-bare") / "model"
    shutil.copytree(tiny_model_factory("llama"), out)
    (out / "generation_config.json").write_text(json.dumps(GENERATION))
    return out


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


# ---------------------------------------------------------------------------- reading
def test_auto_reads_the_sampling_keys(model_dir: Path) -> None:
    assert default_sampling(ModelConfig(), model_dir, None) == {
        **DEFAULT_MODEL_SAMPLING,  # model=None: the default model's own, then the file's
        **DEFAULTS,
    }
    assert default_sampling(ModelConfig(model="x"), model_dir, None) == DEFAULTS


def test_vllm_ignores_and_a_path_replaces(model_dir: Path, tmp_path: Path) -> None:
    assert default_sampling(ModelConfig(model="x", generation_config="vllm"), model_dir, None) == {}
    assert default_sampling(ModelConfig(generation_config="vllm"), model_dir, None) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    other = ModelConfig(model="x", generation_config=str(tmp_path))
    assert default_sampling(other, model_dir, None) == {"top_p": 0.5}
    missing = ModelConfig(model="x", generation_config=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"^generation_config: .* not a folder holding"):
        default_sampling(missing, model_dir, None)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"top_p": 0.0}, r"sets an invalid top_p: must be in \(0, 1\]"),
        ({"temperature": "hot"}, r"temperature must be a number"),
        ([1, 2], r"is not a JSON object"),
    ],
)
def test_a_bad_file_is_a_startup_error(tmp_path: Path, content: Any, message: str) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(content))
    with pytest.raises(ValueError, match=rf"^generation_config: .*{message}"):
        default_sampling(ModelConfig(model="x"), tmp_path, None)


def test_gguf_sampling_metadata(tmp_path: Path, model_dir: Path) -> None:
    path = tmp_path / "meta.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_float32("general.sampling.top_p", 0.8)
    writer.add_int32("general.sampling.top_k", 40)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = from_gguf(path)
    assert found == {"temperature": pytest.approx(0.7), "top_p": pytest.approx(0.8), "top_k": 40}
    # generation_config.json wins where both set a key.
    both = default_sampling(ModelConfig(model="x"), model_dir, path)
    assert both == {**found, **DEFAULTS}


# ---------------------------------------------------------------------------- offline LLM
def test_llm_defaults_apply_when_sampling_params_is_none(bare_dir: Path) -> None:
    llm = LLM(str(bare_dir), **SMALL, max_model_len=256)
    assert llm.get_default_sampling_params() == SamplingParams(**DEFAULTS)  # type: ignore[arg-type]
    prompt = [5, 17, 99, 230, 7]
    plain = llm.generate([prompt], use_tqdm=False)[0].outputs[0]
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=6)
    assert plain.token_ids == llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert len(plain.token_ids) <= 6
    # An explicit SamplingParams is used as given (vLLM): 10 tokens, not the default 6.
    explicit = SamplingParams(max_tokens=10, ignore_eos=True, seed=0)
    assert len(llm.generate([prompt], explicit, use_tqdm=False)[0].outputs[0].token_ids) == 10
    ignoring = LLM(str(bare_dir), **SMALL, max_model_len=256, generation_config="vllm")
    assert ignoring.get_default_sampling_params() == SamplingParams()


def test_llm_chat_template(model_dir: Path, template_file: Path) -> None:
    llm = LLM(str(model_dir), **SMALL, max_model_len=256, chat_template=str(template_file))
    assert llm.tokenizer is not None
    expected = llm.tokenizer(RENDERED, add_special_tokens=False)["input_ids"]
    one = SamplingParams(max_tokens=1)
    assert llm.chat(HELLO, one, use_tqdm=False)[0].prompt_token_ids == expected
    # Inline (vLLM: an argument with Jinja characters is the template itself) and per call.
    inline = LLM(str(model_dir), **SMALL, max_model_len=256, chat_template=TEMPLATE)
    assert inline.chat(HELLO, one, use_tqdm=False)[0].prompt_token_ids == expected
    per_call = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    out = inline.chat(HELLO, one, use_tqdm=False, chat_template=per_call)[0]
    assert (
        out.prompt_token_ids
        == llm.tokenizer("<Hello there>", add_special_tokens=False)["input_ids"]
    )
    with pytest.raises(ValueError, match=r"^chat_template: 'no/such.jinja' looks like a file"):
        LLM(str(model_dir), **SMALL, chat_template="no/such.jinja")
    with pytest.raises(ValueError, match=r"^chat_template: not a valid Jinja template"):
        LLM(str(model_dir), **SMALL, chat_template="{% for m in messages %}")


# ---------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def harness(model_dir: Path, template_file: Path) -> Iterator[ServerHarness]:
    """The model served as ``tokenwire serve`` runs it (engine core in its own process), with
    ``--chat-template FILE`` and ``--generation-config auto``."""
    h = ServerHarness(model_dir, num_blocks=64)
    model = dataclasses.replace(h.config.model, chat_template=str(template_file))
    h.config = dataclasses.replace(h.config, model=model)
    h.start()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def rest(harness: ServerHarness) -> Iterator[httpx.Client]:
    server = RestHarness(harness).start()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
    server.stop()


def test_model_info_shows_the_defaults(harness: ServerHarness) -> None:
    with Client(harness.target, timeout=60) as client:
        info = client.model_info()
    sampling = info.default_sampling
    assert sampling.HasField("temperature") and sampling.temperature == 0.0
    assert (sampling.top_k, sampling.repetition_penalty) == (20, pytest.approx(1.05))
    assert not sampling.HasField("top_p") and not sampling.HasField("min_p")
    assert info.HasField("default_max_tokens") and info.default_max_tokens == 6
    assert isinstance(info, models_pb2.ModelInfo)


def test_grpc_defaults_apply_and_requests_override(harness: ServerHarness) -> None:
    with Client(harness.target, timeout=60) as client:
        plain = client.generate(messages=HELLO)
        greedy = client.generate(messages=HELLO, temperature=0.0, max_tokens=6)
        rendered = client.tokenize(RENDERED, add_special_tokens=False)
        assert plain.usage.prompt_tokens == len(rendered)  # --chat-template rendered it
        assert plain.choices[0].token_ids == greedy.choices[0].token_ids  # temperature 0
        assert len(plain.choices[0].token_ids) <= 6  # max_new_tokens
        three = client.generate(messages=HELLO, max_tokens=3, ignore_eos=True)
        assert three.choices[0].token_ids == greedy.choices[0].token_ids[:3]
        # temperature 1.0 given per request: sampled, no longer the greedy answer.
        sampled = [
            client.generate(messages=HELLO, temperature=1.0, seed=s, ignore_eos=True)
            for s in range(3)
        ]
        assert all(len(s.choices[0].token_ids) == 6 for s in sampled)
        assert any(s.choices[0].token_ids != greedy.choices[0].token_ids for s in sampled)
    harness.assert_idle()


def test_rest_defaults_apply_to_fields_not_sent(harness: ServerHarness, rest: httpx.Client) -> None:
    with Client(harness.target, timeout=60) as client:
        greedy = client.generate(messages=HELLO, temperature=0.0, max_tokens=6)
    body = {"model": "tiny", "messages": HELLO}
    reply = rest.post("/v1/chat/completions", json=body).json()
    assert reply["choices"][0]["message"]["content"] == greedy.choices[0].text
    assert reply["usage"]["prompt_tokens"] == greedy.usage.prompt_tokens
    assert reply["usage"]["completion_tokens"] == len(greedy.choices[0].token_ids)
    hot = rest.post(
        "/v1/chat/completions",
        json={**body, "temperature": 1.0, "seed": 1, "max_tokens": 12, "ignore_eos": True},
    ).json()
    assert hot["usage"]["completion_tokens"] == 12
    harness.assert_idle()


def test_tokenwire_chat_uses_the_defaults(harness: ServerHarness) -> None:
    with Client(harness.target, timeout=60) as client:
        greedy = client.generate(messages=HELLO, temperature=0.0, max_tokens=6)
    lines = iter(["Hello there"])

    def answer(_: str) -> str:
        line = next(lines, None)
        if line is None:
            raise EOFError
        return line

    out = io.StringIO()
    assert run_chat(harness.target, None, "", None, None, None, input_fn=answer, out=out) == 0
    assert greedy.choices[0].text.strip() in out.getvalue()
    harness.assert_idle()


# ---------------------------------------------------------------------------- default model
@pytest.mark.slow
def test_default_model_answers_a_plain_request() -> None:
    """No sampling field at all, as a plain OpenAI request sends it: the default model's
    built-in default (greedy, nothing else) answers with Paris."""
    harness = ServerHarness(None, in_process=True, num_blocks=64).start()
    try:
        with Client(harness.target, timeout=120) as client:
            info = client.model_info()
            assert info.default_sampling.temperature == 0.0
            assert not info.default_sampling.HasField("repetition_penalty")
        rest = RestHarness(harness).start()
        try:
            question = [{"role": "user", "content": "What is the capital of France?"}]
            body = {"model": "tiny", "messages": question}
            with httpx.Client(base_url=rest.url, timeout=120) as http:
                reply = http.post("/v1/chat/completions", json=body).json()
        finally:
            rest.stop()
        assert "Paris" in reply["choices"][0]["message"]["content"]
        assert reply["choices"][0]["finish_reason"] == "stop"
        harness.assert_idle()
    finally:
        harness.stop()
