"""Completions ``echo`` with ``logprobs`` and with ``max_tokens: 0`` (``rest/echo``), through
the real OpenAI SDK on a tiny random llama with the default model's tokenizer: the choice's
logprobs start with the prompt's tokens — the first with null logprob and top, each later one
with HF's log-softmax of it (what evaluation harnesses read a continuation's log-likelihood
from) and its top ``k`` —, then the generated tokens' logprobs of the same request without
echo; ``max_tokens: 0`` shows the prompt alone; a stream with either is a 400 naming echo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from rest_harness import RestHarness
from server_harness import MODEL_NAME
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = [1, 50, 300, 7, 999, 42, 5000, 17, 3, 88, 1200, 64, 9, 31000, 456, 2, 777, 12]
TEXT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512, in_process=True)


def _log_softmax(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """HF's log-softmax over ``ids``: row i predicts ids[i + 1]."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _create(client: openai.OpenAI, prompt: str | list[int], **kwargs: Any) -> Any:
    return client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0.0, **kwargs)


def test_echo_with_logprobs_starts_with_the_prompts(
    openai_client: openai.OpenAI, harness_model: Path
) -> None:
    echoed = _create(openai_client, PROMPT, max_tokens=4, echo=True, logprobs=2)
    plain = _create(openai_client, PROMPT, max_tokens=4, logprobs=2)
    got, want = echoed.choices[0].logprobs, plain.choices[0].logprobs
    n = len(PROMPT)
    assert len(got.tokens) == n + 4
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    reference = _log_softmax(harness_model, PROMPT)
    for i in range(1, n):
        assert got.token_logprobs[i] == pytest.approx(float(reference[i - 1, PROMPT[i]]), abs=1e-3)
        top = got.top_logprobs[i]
        assert got.tokens[i] in top and len(top) <= 3  # top 2, and the prompt's own token
        best = reference[i - 1].topk(2)
        assert max(top.values()) == pytest.approx(float(best.values[0]), abs=1e-3)
    assert got.tokens[n:] == want.tokens
    assert got.token_logprobs[n:] == pytest.approx(want.token_logprobs, abs=1e-5)
    offsets = got.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[n] == sum(len(t) for t in got.tokens[:n])
    decoded = AutoTokenizer.from_pretrained(harness_model).decode(PROMPT)
    assert echoed.choices[0].text == decoded + plain.choices[0].text


def test_echo_without_generation_shows_the_prompt_alone(
    openai_client: openai.OpenAI, harness_model: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(harness_model)
    ids = tokenizer(TEXT)["input_ids"]
    reply = _create(openai_client, TEXT, max_tokens=0, echo=True, logprobs=1)
    choice = reply.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(ids)
    lps = choice.logprobs
    assert lps.tokens[0] == tokenizer.decode(ids[:1]) and lps.token_logprobs[0] is None
    assert len(lps.tokens) == len(ids)
    reference = _log_softmax(harness_model, ids)
    want = [float(reference[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert lps.token_logprobs[1:] == pytest.approx(want, abs=1e-3)
    bare = _create(openai_client, TEXT, max_tokens=0, echo=True)
    assert bare.choices[0].text == TEXT and bare.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
        ({"echo": True, "max_tokens": 0, "stream": True}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_what_echo_cannot_do_is_400_naming_it(
    rest: RestHarness, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL_NAME, "prompt": "Hello", **extra}
    reply = httpx.post(f"{rest.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
