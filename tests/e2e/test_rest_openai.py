"""The official ``openai`` SDK (sync and async) against a real ``tokenwire serve`` subprocess
with the default model: chat and completions, streamed and not, ``n``, ``stop``, ``seed``,
logprobs, usage, ``models.list()``, and the SDK's own typed errors for server errors."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import openai
import pytest
from pydantic import BaseModel, Field
from tiny_models import DEFAULT_MODEL_TEST_KV_BYTES

pytestmark = pytest.mark.slow

KEY = "sk-test-key"
MODEL = "SmolLM2-135M-Instruct"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def _start(*args: str, pattern: str) -> tuple[subprocess.Popen[str], re.Match[str]]:
    """Run ``tokenwire ARGS`` until its log line matches ``pattern`` (bound ports)."""
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
    assert exe is not None
    proc = subprocess.Popen(
        [exe, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # blocks until the server reports its bound ports
        match = re.search(pattern, line)
        if match:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep it flowing
            return proc, match
    raise AssertionError(f"tokenwire {' '.join(args)} exited before serving")


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, str]]:
    """(REST base URL, gRPC target) of one ``tokenwire serve`` with an API key."""
    proc, match = _start(
        "serve",
        "--grpc-port",
        "0",
        "--port",
        "0",
        "--api-key",
        KEY,
        "--max-requests",
        "2",
        "--kv-cache-memory",
        str(DEFAULT_MODEL_TEST_KV_BYTES),
        pattern=r"serving model=.* grpc=(\S+:\d+) rest=(\S+)",
    )
    yield f"{match.group(2)}/v1", match.group(1)
    proc.terminate()
    assert proc.wait(timeout=60) == 0  # drains and stops REST and gRPC cleanly


@pytest.fixture(scope="module")
def base_url(server: tuple[str, str]) -> str:
    return server[0]


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def test_chat_paris_and_models(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=PARIS,
        temperature=0,
        max_tokens=30,  # type: ignore[arg-type]
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason == "stop" and reply.object == "chat.completion"
    assert reply.usage is not None and reply.usage.prompt_tokens > 0
    assert reply.usage.prompt_tokens_details is not None
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_stream_equals_unary_with_usage(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=PARIS, temperature=0, max_completion_tokens=24)
    unary = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f] == [unary.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens  # type: ignore[union-attr]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0  # type: ignore[union-attr]


def test_n_stop_and_seed(client: openai.OpenAI) -> None:
    two = client.chat.completions.create(
        model=MODEL,
        messages=PARIS,
        n=2,
        temperature=0,
        max_tokens=20,  # type: ignore[arg-type]
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.choices[0].message.content == two.choices[1].message.content  # greedy
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=PARIS,
            n=2,
            temperature=0,
            max_tokens=20,
            stream=True,  # type: ignore[arg-type]
        )
    )
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason is not None
        assert [c.finish_reason for c in mine].count(None) == len(mine) - 1
        text = "".join(c.delta.content or "" for c in mine)
        assert text == two.choices[index].message.content
    stopped = client.chat.completions.create(
        model=MODEL,
        messages=PARIS,
        temperature=0,
        max_tokens=30,
        stop=[" Paris"],  # type: ignore[arg-type]
    )
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and "Paris" not in (choice.message.content or "")
    assert choice.model_extra is not None and choice.model_extra["stop_reason"] == " Paris"

    def sample(seed: int) -> str:
        reply = client.completions.create(
            model=MODEL, prompt="Once upon a time", temperature=1.0, seed=seed, max_tokens=16
        )
        return reply.choices[0].text

    assert sample(7) == sample(7)


def test_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=PARIS,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    for position in content:
        assert position.logprob <= 0 and len(position.top_logprobs) == 2
        assert position.top_logprobs[0].logprob >= position.top_logprobs[1].logprob
        assert bytes(position.bytes or []).decode(errors="replace") is not None
    assert content[0].token == content[0].top_logprobs[0].token  # greedy picks the top one
    text = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4, logprobs=1
    )
    lp = text.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
    assert "".join(lp.tokens) == text.choices[0].text


def test_completions_prompt_kinds(client: openai.OpenAI) -> None:
    one = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=5)
    assert one.object == "text_completion" and one.choices[0].finish_reason == "length"
    assert one.usage is not None and one.usage.completion_tokens == 5
    ids = client.completions.create(model=MODEL, prompt=[9906, 11], temperature=0, max_tokens=3)
    assert ids.usage is not None and ids.usage.prompt_tokens == 2
    both = client.completions.create(
        model=MODEL, prompt=["Hello", "Goodbye"], temperature=0, max_tokens=3
    )
    texts = {c.index: c.text for c in both.choices}
    assert sorted(texts) == [0, 1]
    assert one.choices[0].text.startswith(texts[0])  # greedy: the same start as alone


def test_async_client(base_url: str) -> None:
    async def main() -> tuple[str, str, str]:
        async with openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0) as c:
            chat = await c.chat.completions.create(
                model=MODEL,
                messages=PARIS,
                temperature=0,
                max_tokens=30,  # type: ignore[arg-type]
            )
            stream = await c.completions.create(
                model=MODEL, prompt="Hello", temperature=0, max_tokens=6, stream=True
            )
            streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
            unary = await c.completions.create(
                model=MODEL, prompt="Hello", temperature=0, max_tokens=6
            )
            return chat.choices[0].message.content or "", streamed, unary.choices[0].text

    chat, streamed, unary = asyncio.run(main())
    assert "Paris" in chat and streamed == unary


class City(BaseModel):
    name: str
    country: str
    population: int = Field(ge=0)


def test_structured_outputs_with_the_default_model(client: openai.OpenAI) -> None:
    """``chat.completions.parse`` with a pydantic model, and JSON mode, on real weights."""
    ask = [{"role": "user", "content": "Describe Paris as JSON: name, country, population."}]
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    reply = parse(model=MODEL, messages=ask, response_format=City, temperature=0, max_tokens=120)
    assert isinstance(reply.choices[0].message.parsed, City)
    assert reply.choices[0].finish_reason == "stop"
    mode = client.chat.completions.create(
        model=MODEL,
        messages=ask,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    )
    assert isinstance(json.loads(mode.choices[0].message.content or ""), dict)


def test_typed_errors(base_url: str, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=PARIS, temperature=-1)  # type: ignore[arg-type]
    assert bad.value.param == "temperature" and bad.value.code == "invalid_parameter"
    for kwargs, param in (
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        # (tools with tool_choice auto are answered: the chat template picks the parser.)
        ({"tool_choice": "required"}, "tool_choice"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL, messages=PARIS, **kwargs)  # type: ignore[call-overload]
        assert bad.value.param == param
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[])
    assert bad.value.param == "messages"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert missing.value.code == "model_not_found"
    with openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=MODEL, messages=PARIS)  # type: ignore[arg-type]
    with pytest.raises(openai.RateLimitError) as limited:  # 3 prompts, --max-requests 2
        client.completions.create(
            model=MODEL,
            prompt=["a", "b", "c"],
            max_tokens=200,
            extra_body={"ignore_eos": True},
        )
    assert int(limited.value.response.headers["retry-after"]) >= 1
    # The cancelled siblings leave the server's queue asynchronously: retry as told.
    ok = client.with_options(max_retries=5).completions.create(
        model=MODEL, prompt="x", max_tokens=1
    )
    assert ok.usage is not None and ok.usage.completion_tokens == 1


def test_standalone_rest_shim(server: tuple[str, str]) -> None:
    """``tokenwire rest --grpc-target``: the shim as its own process in front of gRPC."""
    proc, match = _start(
        "rest", "--grpc-target", server[1], "--port", "0", pattern=r"serving rest=(\S+)"
    )
    try:
        with openai.OpenAI(base_url=f"{match.group(1)}/v1", api_key=KEY, max_retries=0) as c:
            reply = c.chat.completions.create(
                model=MODEL,
                messages=PARIS,
                temperature=0,
                max_tokens=30,  # type: ignore[arg-type]
            )
            assert "Paris" in (reply.choices[0].message.content or "")
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


@pytest.mark.parametrize("command", ["serve", "rest"])
def test_taken_port_fails_fast_naming_the_flag(command: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
        assert exe is not None
        extra = ["--grpc-port", "0"] if command == "serve" else []
        done = subprocess.run(
            [exe, command, *extra, "--port", port],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONSAFEPATH="1"),
        )
    assert done.returncode == 2 and "--port" in done.stderr
    assert "Loading" not in done.stdout and "serving" not in done.stdout  # before the model
