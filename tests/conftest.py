"""Shared fixtures: tiny random HF models (all supported families), the default tokenizer, and
the one served-harness factory (``harness`` -> ``channel`` -> ``gen``; ``rest`` ->
``openai_client`` / ``http_client``).

Everything is built locally; no network. Tiny models are saved as safetensors directories
with a config.json, exactly what ``LLM(model=path)`` loads. A test module shapes its server by
overriding ``harness_model`` (which model) and ``harness_options`` (``ServerHarness`` keyword
arguments); the harness is started once per module and stopped after it, releasing a gated
observer first so a parked core never blocks the stop. Helpers live in ``tests/support/``
(on ``sys.path`` through pytest's ``pythonpath``). Conftest defines every Triton kernel
under the CPU interpreter before any test module is imported (``interpreted_kernels``), so
collection order never decides compiled vs interpreted; the fixtures still import the server
side lazily.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from interpreted_kernels import define_kernels_interpreted
from tiny_models import build_tiny_model, default_gguf_path

if TYPE_CHECKING:
    import grpc
    import httpx
    import openai
    from rest_harness import RestHarness
    from server_harness import ServerHarness

    from tokenwire.v1 import generation_pb2_grpc

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
define_kernels_interpreted()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple[str, str], Path] = {}

    def make(family: str, **overrides: Any) -> Path:
        key = (family, repr(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            cache[key] = build_tiny_model(family, out, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def smollm_tokenizer() -> Any:
    """The default model's tokenizer (read from its GGUF by transformers)."""
    from transformers import AutoTokenizer

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def tiny_model_with_tokenizer(
    tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any
) -> Path:
    """A tiny random llama with the default model's vocabulary, tokenizer and chat template:
    text and chat input work, and it loads in a fraction of a second."""
    out = tmp_path_factory.mktemp("tiny-llama-tokenizer")
    build_tiny_model("llama", out, vocab_size=len(smollm_tokenizer))
    smollm_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def harness_model(tiny_model_factory: Callable[..., Path]) -> Path:
    """The model a module's ``harness`` serves (override per module)."""
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    """``ServerHarness`` keyword arguments for a module's ``harness`` (override per module)."""
    return {}


@pytest.fixture(scope="module")
def harness(harness_model: Path, harness_options: dict[str, Any]) -> Iterator[ServerHarness]:
    from server_harness import ServerHarness

    h = ServerHarness(harness_model, **harness_options).start()
    yield h
    release = getattr(harness_options.get("observer"), "release", None)
    if release is not None:  # a gated recorder: let a parked core finish before the stop
        release()
    h.stop()


@pytest.fixture(scope="module")
def channel(harness: ServerHarness) -> Iterator[grpc.Channel]:
    with harness.channel() as ch:
        yield ch


@pytest.fixture(scope="module")
def gen(channel: grpc.Channel) -> generation_pb2_grpc.GenerationServiceStub:
    from tokenwire.v1 import generation_pb2_grpc

    return generation_pb2_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def rest(harness: ServerHarness) -> Iterator[RestHarness]:
    from rest_harness import RestHarness

    r = RestHarness(harness).start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def openai_client(rest: RestHarness, harness_options: dict[str, Any]) -> Iterator[openai.OpenAI]:
    """The real OpenAI SDK on the module's REST shim, with its first API key if it has one."""
    import openai

    key = (*harness_options.get("api_keys", ()), "x")[0]
    with openai.OpenAI(base_url=f"{rest.url}/v1", api_key=key, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http_client(rest: RestHarness) -> Iterator[httpx.Client]:
    import httpx

    with httpx.Client(base_url=rest.url, timeout=60) as c:
        yield c
