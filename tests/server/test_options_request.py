"""Request options on gRPC and REST: ``prompt_logprobs`` (equal to HF's log-softmax over the
prompt), the typed ``priority`` (clamped by the tenant's ``max_priority``, the metadata
winning), ``chat_template_kwargs`` and ``reasoning_effort`` reaching the chat template,
completions ``echo``, ``return_tokens_as_token_ids``, and a bad value of each -> 400 /
INVALID_ARGUMENT naming it.

The model is a tiny random llama with the default model's tokenizer and a chat template that
prints ``enable_thinking`` and ``reasoning_effort`` when they are set.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import httpx
import openai
import pytest
import torch
from grpc_helpers import details_of
from grpc_helpers import greedy_request as request
from rest_harness import RestHarness
from server_harness import MODEL_NAME, ServerHarness
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenwire.server.grpc.call_context import call_context
from tokenwire.server.tenants.config import parse_tenants
from tokenwire.server.tenants.registry import TenantRegistry
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

PROMPT = [1, 50, 300, 7, 999, 42, 5000, 17, 3, 88, 1200, 64, 9, 31000, 456, 2, 777, 12, 4, 900]
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "<|im_start|>system\nno thinking<|im_end|>\n{%- endif %}"
    "{%- if reasoning_effort is defined and reasoning_effort %}"
    "<|im_start|>system\neffort {{ reasoning_effort }}<|im_end|>\n{%- endif %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_with_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-template-kwargs")
    for item in tiny_model_with_tokenizer.iterdir():
        if item.is_file():
            shutil.copy(item, out / item.name)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def harness_model(model_dir: Path) -> Path:
    return model_dir


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512, in_process=True)


@pytest.fixture()
def stub(harness: ServerHarness) -> Iterator[generation_pb2_grpc.GenerationServiceStub]:
    with harness.channel() as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> torch.Tensor:
    """HF's log-softmax over PROMPT: row i predicts PROMPT[i + 1]."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def _check_positions(positions: Any, ref: torch.Tensor, top: int) -> None:
    assert len(positions) == len(PROMPT) - 1
    for i, position in enumerate(positions):
        target = PROMPT[i + 1]
        assert position.chosen.token_id == target
        assert abs(position.chosen.logprob - ref[i, target].item()) < 1e-4
        assert position.chosen.rank == int((ref[i] > ref[i, target]).sum()) + 1
        assert len(position.top) == top
        assert abs(position.top[0].logprob - ref[i].max().item()) < 1e-4


def _with_prompt_logprobs(top: int) -> generation_pb2.GenerateRequest:
    message = request(PROMPT, 2)
    message.output.prompt_logprobs = top
    return message


def test_grpc_prompt_logprobs_equal_hf(stub: Any, reference: torch.Tensor) -> None:
    reply = stub.Generate(_with_prompt_logprobs(2), timeout=60)
    _check_positions(reply.prompt_logprobs, reference, 2)
    events = list(stub.GenerateStream(_with_prompt_logprobs(1), timeout=60))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[-2:] == ["prompt_logprobs", "usage"]
    _check_positions(events[-2].prompt_logprobs.positions, reference, 1)
    plain = stub.Generate(request(PROMPT, 2), timeout=60)
    assert not plain.prompt_logprobs  # only when asked


def test_rest_prompt_logprobs_equal_hf(
    openai_client: openai.OpenAI, reference: torch.Tensor
) -> None:
    reply = openai_client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    body = reply.model_dump()["choices"][0]["prompt_logprobs"]
    assert body[0] is None and len(body) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        entry = body[i][str(PROMPT[i])]
        assert abs(entry["logprob"] - reference[i - 1, PROMPT[i]].item()) < 1e-4
        assert len(body[i]) <= 2
    chat = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    prompt = chat.model_dump()["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == chat.usage.prompt_tokens  # type: ignore[union-attr]


def _prompt_text(openai_client: openai.OpenAI, **extra: Any) -> str:
    """The rendered chat prompt, read back from its prompt logprobs (after the first token)."""
    chat = openai_client.chat.completions.create(
        model=MODEL_NAME,
        messages=HELLO,
        max_tokens=1,
        extra_body={"prompt_logprobs": 0, **extra},
    )
    positions = chat.model_dump()["prompt_logprobs"][1:]
    return "".join(next(iter(p.values()))["decoded_token"] for p in positions)


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(
    openai_client: openai.OpenAI, stub: Any
) -> None:
    plain = _prompt_text(openai_client)
    assert "Hello there" in plain and "no thinking" not in plain and "effort" not in plain
    assert "no thinking" in _prompt_text(
        openai_client, chat_template_kwargs={"enable_thinking": False}
    )
    assert "no thinking" not in _prompt_text(
        openai_client, chat_template_kwargs={"enable_thinking": True}
    )
    assert "effort high" in _prompt_text(openai_client, reasoning_effort="high")
    chat = common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content="Hi")])
    base = generation_pb2.GenerateRequest(
        chat=chat, stopping=common_pb2.StoppingOptions(max_tokens=1)
    )
    tokens = stub.Generate(base, timeout=60).usage.prompt_tokens
    base.chat.chat_template_kwargs_json = '{"enable_thinking": false}'
    base.chat.reasoning_effort = "low"
    assert stub.Generate(base, timeout=60).usage.prompt_tokens > tokens


def test_responses_reasoning_effort_reaches_the_template(openai_client: openai.OpenAI) -> None:
    plain = openai_client.responses.create(
        model=MODEL_NAME, input="Hi", max_output_tokens=1, store=False
    )
    effort = openai_client.responses.create(
        model=MODEL_NAME, input="Hi", max_output_tokens=1, store=False, reasoning={"effort": "low"}
    )
    assert effort.usage.input_tokens > plain.usage.input_tokens  # type: ignore[union-attr]


def test_typed_priority_and_metadata_reach_the_engine(
    harness: ServerHarness, rest: RestHarness, stub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    add_request = harness.engine.add_request

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["priority"])
        return add_request(*args, **kwargs)

    monkeypatch.setattr(harness.engine, "add_request", spy)
    message = request([1, 2], 1)
    message.priority = -7
    stub.Generate(message, timeout=30)
    stub.Generate(message, metadata=(("x-priority", "4"),), timeout=30)  # the metadata wins
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1, "priority": 9}
    assert httpx.post(f"{rest.url}/v1/completions", json=body, timeout=60).status_code == 200
    assert seen == [-7, 4, 9]


class _Item(NamedTuple):  # a gRPC metadatum: unpacks and has .key / .value
    key: str
    value: str


class _Context:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> list[_Item]:
        return [_Item(k, v) for k, v in self.metadata]


def test_typed_priority_is_clamped_by_max_priority() -> None:
    tenants = parse_tenants({"tenants": [{"name": "p", "keys": ["plain:kp"], "max_priority": 3}]})
    registry = TenantRegistry(tenants)
    auth = (("authorization", "Bearer kp"),)
    context: Any = _Context(auth)
    assert call_context(context, registry, "", -5).priority == 3  # may not go below 3
    assert call_context(context, registry, "", 8).priority == 8
    assert call_context(_Context((*auth, ("x-priority", "1"))), registry, "", 8).priority == 3  # type: ignore[arg-type]
    assert call_context(_Context((*auth, ("x-priority", "6"))), registry, "", 8).priority == 6  # type: ignore[arg-type]


def test_echo_and_token_ids_as_names(openai_client: openai.OpenAI, model_dir: Path) -> None:
    reply = openai_client.completions.create(
        model=MODEL_NAME, prompt="Hello there", max_tokens=3, echo=True, temperature=0.0
    )
    plain = openai_client.completions.create(
        model=MODEL_NAME, prompt="Hello there", max_tokens=3, temperature=0.0
    )
    assert reply.choices[0].text == "Hello there" + plain.choices[0].text
    stream = openai_client.completions.create(
        model=MODEL_NAME, prompt="Hello there", max_tokens=3, echo=True, stream=True
    )
    texts = [c.choices[0].text for c in stream if c.choices]
    assert texts[0] == "Hello there"
    ids = openai_client.completions.create(
        model=MODEL_NAME, prompt=PROMPT[:5], max_tokens=1, echo=True
    )
    decoded = AutoTokenizer.from_pretrained(model_dir).decode(PROMPT[:5])
    assert ids.choices[0].text.startswith(decoded)
    named = openai_client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=3,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    tokens = named.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert tokens and all(t.startswith("token_id:") for t in tokens)
    chat = openai_client.chat.completions.create(
        model=MODEL_NAME,
        messages=HELLO,
        max_tokens=3,
        logprobs=True,
        top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(t.token.startswith("token_id:") for t in content)
    assert all(t.top_logprobs[0].token.startswith("token_id:") for t in content)


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("completions", {"echo": "yes"}, "echo"),
        ("completions", {"echo": True, "logprobs": 1, "stream": True}, "echo"),
        ("completions", {"return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
        ("completions", {"priority": 2**31}, "priority"),
        ("chat/completions", {"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        (
            "chat/completions",
            {"chat_template_kwargs": {"add_generation_prompt": False}},
            "chat_template_kwargs",
        ),
        ("chat/completions", {"chat_template_kwargs": {"9x": 1}}, "chat_template_kwargs"),
        ("chat/completions", {"reasoning_effort": "ultra"}, "reasoning_effort"),
    ],
)
def test_bad_option_is_400_naming_it(
    rest: RestHarness, route: str, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 1, **extra}
    if route == "completions":
        body["prompt"] = "Hi"
    else:
        body["messages"] = HELLO
    reply = httpx.post(f"{rest.url}/v1/{route}", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


@pytest.mark.parametrize(
    ("mutate", "param"),
    [
        (lambda m: m.output.__setattr__("prompt_logprobs", 21), "prompt_logprobs"),
        (lambda m: m.__setattr__("retain_kv_as", "x" * 200), "retain_kv_as"),
        (lambda m: m.chat.__setattr__("chat_template_kwargs_json", "[1]"), "chat_template_kwargs"),
        (lambda m: m.chat.__setattr__("chat_template_kwargs_json", "{"), "chat_template_kwargs"),
        (
            lambda m: m.chat.__setattr__("chat_template_kwargs_json", '{"tokenize": true}'),
            "chat_template_kwargs",
        ),
        (lambda m: m.chat.__setattr__("reasoning_effort", "ultra"), "reasoning_effort"),
    ],
)
def test_bad_option_is_invalid_argument_naming_it(stub: Any, mutate: Any, param: str) -> None:
    chat = common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content="Hi")])
    message = generation_pb2.GenerateRequest(
        chat=chat, stopping=common_pb2.StoppingOptions(max_tokens=1)
    )
    mutate(message)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(message, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info, _ = details_of(err.value)
    assert info is not None and info.metadata["param"] == param


def test_retained_kv_is_reused_and_released(harness: ServerHarness, stub: Any) -> None:
    prompt = list(range(200, 240))  # two full blocks and a part
    message = request(prompt, 4)
    message.retain_kv_as = "conv-1"
    message.cache_salt = "retain-test"
    first = stub.Generate(message, timeout=30)
    assert first.usage.cached_tokens == 0
    follow = request([*prompt, *first.choices[0].token_ids, 5, 6], 1)
    follow.cache_salt = "retain-test"
    assert stub.Generate(follow, timeout=30).usage.cached_tokens >= 32
    stub.ReleaseKv(generation_pb2.ReleaseKvRequest(keys=["conv-1", "unknown"]), timeout=30)
    harness.assert_idle()  # the held blocks went back
