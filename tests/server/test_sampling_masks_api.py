"""vLLM's ``allowed_token_ids``, ``bad_words`` and ``truncate_prompt_tokens`` through gRPC and
the REST shim (a tiny random llama with the default model's tokenizer): the masks hold in the
answer, bad words are tokenized as vLLM does, a truncated prompt answers as its last k tokens
sent alone (``usage.prompt_tokens`` counting them), and bad values name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_helpers import details_of
from server_harness import MODEL_NAME

from tokenwire.runtime.front.bad_words import bad_words_token_ids
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

TEXT = "The quick brown fox jumps over the lazy dog and keeps running through the field"
WORDS = ["hello", " world", "tokenization", "Hello there", "!", "  the", "ÿes", "1234567"]


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512, in_process=True)


def vllm_rule(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's ``SamplingParams.update_from_tokenizer``, restated with ``encode``."""
    out: list[list[int]] = []
    for word in words:
        for spaced in (False, True):
            text = (" " if spaced else "") + word.lstrip()
            ids = tokenizer.encode(text, add_special_tokens=False)
            if not spaced or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return out


def test_bad_words_tokenize_as_vllm(smollm_tokenizer: Any) -> None:
    ours = bad_words_token_ids(smollm_tokenizer, WORDS)
    assert [list(ids) for ids in ours] == vllm_rule(smollm_tokenizer, WORDS)
    # "hello" and " hello" are different single tokens: both forms are banned
    assert len([ids for ids in ours if len(ids) == 1]) >= 2 and len(ours) > len(WORDS)


def generate(
    gen: generation_pb2_grpc.GenerationServiceStub, **fields: Any
) -> generation_pb2.GenerateResponse:
    sampling = common_pb2.SamplingOptions(temperature=0.0, **fields.pop("sampling", {}))
    stopping = common_pb2.StoppingOptions(max_tokens=12, ignore_eos=True)
    request = generation_pb2.GenerateRequest(sampling=sampling, stopping=stopping, **fields)
    return gen.Generate(request, timeout=60)


def test_grpc_allowed_token_ids(gen: generation_pb2_grpc.GenerationServiceStub) -> None:
    allowed = [300, 301, 4000, 4001, 4002]
    plain = generate(gen, text=TEXT).choices[0].token_ids
    masked = generate(gen, text=TEXT, sampling={"allowed_token_ids": allowed})
    assert set(masked.choices[0].token_ids) <= set(allowed) and not set(plain) <= set(allowed)


def a_word_of(tokens: list[int], tokenizer: Any) -> tuple[str, int]:
    """A word whose (spaced or plain) single-token form is one of ``tokens``."""
    return next(
        (w, t)
        for t in tokens
        if (w := tokenizer.decode([t]).strip()) and (t,) in bad_words_token_ids(tokenizer, [w])
    )


def test_grpc_bad_words_drop_a_word_of_the_answer(
    gen: generation_pb2_grpc.GenerationServiceStub, smollm_tokenizer: Any
) -> None:
    plain = list(generate(gen, text=TEXT).choices[0].token_ids)
    word, token = a_word_of(plain, smollm_tokenizer)
    masked = list(generate(gen, text=TEXT, sampling={"bad_words": [word]}).choices[0].token_ids)
    assert token not in masked and masked != plain


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        ({"allowed_token_ids": [5, 10**6]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
    ],
)
def test_grpc_bad_masks_are_invalid_argument(
    gen: generation_pb2_grpc.GenerationServiceStub, sampling: dict[str, Any], param: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(gen, text=TEXT, sampling=sampling)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info, _ = details_of(err.value)
    assert info is not None and info.metadata["param"] == param


def test_grpc_truncate_prompt_tokens(
    gen: generation_pb2_grpc.GenerationServiceStub, smollm_tokenizer: Any
) -> None:
    ids = smollm_tokenizer(TEXT)["input_ids"]
    assert len(ids) > 10
    cut = generate(gen, text=TEXT, truncate_prompt_tokens=5)
    tail = generate(gen, token_ids=common_pb2.TokenIds(ids=ids[-5:]))
    assert cut.choices[0].token_ids == tail.choices[0].token_ids
    assert cut.usage.prompt_tokens == 5
    whole = generate(gen, text=TEXT, truncate_prompt_tokens=-1)  # the context: all of it
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.choices[0].token_ids != cut.choices[0].token_ids
    with pytest.raises(grpc.RpcError) as err:
        generate(gen, text=TEXT, truncate_prompt_tokens=-2)
    info, _ = details_of(err.value)
    assert info is not None and info.metadata["param"] == "truncate_prompt_tokens"


def post(http: httpx.Client, route: str, **body: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0.0, **body}
    r = http.post(f"/v1/{route}", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def ids_of(reply: dict[str, Any]) -> list[int]:
    """A completions choice's token ids (``return_tokens_as_token_ids`` logprobs)."""
    return [int(t.removeprefix("token_id:")) for t in reply["choices"][0]["logprobs"]["tokens"]]


def test_rest_completions_masks_and_truncation(
    http_client: httpx.Client, smollm_tokenizer: Any
) -> None:
    extra = {"logprobs": 0, "return_tokens_as_token_ids": True, "ignore_eos": True}
    allowed = [300, 301, 4000]
    masked = post(http_client, "completions", prompt=TEXT, allowed_token_ids=allowed, **extra)
    assert set(ids_of(masked)) <= set(allowed)
    plain = ids_of(post(http_client, "completions", prompt=TEXT, **extra))
    word, token = a_word_of(plain, smollm_tokenizer)
    banned = ids_of(post(http_client, "completions", prompt=TEXT, bad_words=[word], **extra))
    assert token not in banned and banned != plain
    ids = smollm_tokenizer(TEXT)["input_ids"]
    cut = post(http_client, "completions", prompt=TEXT, truncate_prompt_tokens=4, **extra)
    tail = post(http_client, "completions", prompt=ids[-4:], **extra)
    assert ids_of(cut) == ids_of(tail) and cut["usage"]["prompt_tokens"] == 4


def test_rest_chat_truncation_and_refusals(http_client: httpx.Client) -> None:
    messages = [{"role": "user", "content": TEXT}]
    full = post(http_client, "chat/completions", messages=messages)
    cut = post(http_client, "chat/completions", messages=messages, truncate_prompt_tokens=6)
    assert cut["usage"]["prompt_tokens"] == 6 < full["usage"]["prompt_tokens"]
    r = http_client.post(
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": messages, "allowed_token_ids": []},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"
    r = http_client.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": TEXT, "echo": True, "truncate_prompt_tokens": 3},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
