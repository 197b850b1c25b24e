"""Qwen2.5-VL served (#33): a tiny random ``Qwen2_5_VLForConditionalGeneration`` (SmolLM2's
tokenizer and chat template, a dynamic-resolution vision transformer) behind the REST shim.
The real OpenAI SDK's ``image_url`` part becomes ``<|vision_start|><|image_pad|><|vision_end|>``
where the part stood (as Qwen's chat template renders an image), the pad expanded by the
engine to one placeholder per merged patch of that image (two image sizes: two run lengths);
the greedy tokens equal the offline engine's for the same prompt ids and image (which equal
HF ``generate()``: ``tests/runtime/test_qwen_vl.py``); a prompt differing only in its image
gets other logprobs and no cache hit past the text before it; the same image again hits
past it. A gRPC ``ImagePart`` gives the offline engine's tokens too."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from PIL import Image
from server_harness import ServerHarness
from tiny_llava import synthetic_image
from tiny_qwen_vl import save_tiny_qwen_vl

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

# SmolLM2 special tokens no template or user text produces: image pad, vision start and
# end, video pad.
IMAGE, START, END, VIDEO = 4, 5, 6, 7
NEW_TOKENS = 6
BEFORE, AFTER = "Look at this: ", " What is it?"
SIZES = {(24, 32): 12, (40, 48): 30}  # pixels -> placeholder tokens (8 x 8 pixels each)


def _png(seed: int, size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    synthetic_image(seed, size).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def harness_model(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any) -> Path:
    path = tmp_path_factory.mktemp("qwen2_5_vl-served")
    save_tiny_qwen_vl(path, vocab_size=len(smollm_tokenizer), tokens=(IMAGE, START, END, VIDEO))
    smollm_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def offline(harness_model: Path) -> Iterator[LLM]:
    yield LLM(str(harness_model), device="cpu", max_model_len=512)


def _expected_ids(tokenizer: Any) -> list[int]:
    """The template's render with the image's three tokens where its part stood (tokenized
    independently of the server's code)."""
    marker = "@@IMAGE@@"
    messages = [{"role": "user", "content": BEFORE + marker + AFTER}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    head, tail = text.split(marker)

    def encode(piece: str) -> list[int]:
        return list(tokenizer(piece, add_special_tokens=False)["input_ids"])

    return [*encode(head), START, IMAGE, END, *encode(tail)]


def _offline(llm: LLM, tokenizer: Any, png: bytes) -> tuple[list[int], list[float]]:
    prompt = {
        "prompt_token_ids": _expected_ids(tokenizer),
        "multi_modal_data": {"image": [Image.open(io.BytesIO(png)).convert("RGB")]},
    }
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=1)
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    tokens = list(completion.token_ids)
    return tokens, [step[t].logprob for step, t in zip(completion.logprobs, tokens, strict=True)]


def _chat(client: openai.OpenAI, png: bytes) -> Any:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [
        {"type": "text", "text": BEFORE},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": AFTER},
    ]
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],  # type: ignore[list-item,misc]
        temperature=0.0,
        max_tokens=NEW_TOKENS,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
    )


def _token_ids(completion: Any) -> list[int]:
    return [int(t.token.removeprefix("token_id:")) for t in completion.choices[0].logprobs.content]


def _logprobs(completion: Any) -> list[float]:
    return [t.logprob for t in completion.choices[0].logprobs.content]


@pytest.mark.parametrize("size", sorted(SIZES))
def test_openai_image_part_matches_the_offline_engine(
    openai_client: openai.OpenAI,
    offline: LLM,
    smollm_tokenizer: Any,
    harness: ServerHarness,
    size: tuple[int, int],
) -> None:
    expected_ids = _expected_ids(smollm_tokenizer)
    png = _png(1, size)
    completion = _chat(openai_client, png)
    assert completion.usage.prompt_tokens == len(expected_ids) - 1 + SIZES[size]
    tokens, lps = _offline(offline, smollm_tokenizer, png)
    assert _token_ids(completion) == tokens
    assert _logprobs(completion) == pytest.approx(lps, abs=1e-3)
    other = _chat(openai_client, _png(7, size))
    other_tokens, other_lps = _offline(offline, smollm_tokenizer, _png(7, size))
    assert _token_ids(other) == other_tokens
    assert _logprobs(other) == pytest.approx(other_lps, abs=1e-3)
    assert _logprobs(other) != pytest.approx(_logprobs(completion), abs=1e-3)  # the image counts
    before = expected_ids.index(IMAGE)
    assert other.usage.prompt_tokens_details.cached_tokens <= before
    again = _chat(openai_client, png)
    assert again.usage.prompt_tokens_details.cached_tokens > before
    assert _token_ids(again) == _token_ids(completion)
    harness.assert_idle()


def test_grpc_image_part_matches_the_offline_engine(
    gen: generation_pb2_grpc.GenerationServiceStub,
    offline: LLM,
    smollm_tokenizer: Any,
    harness: ServerHarness,
) -> None:
    """A gRPC ``ImagePart`` renders the same prompt (vision start and end around the pad)."""
    png = _png(3, (40, 48))
    image = common_pb2.ImagePart(data=png, mime_type="image/png")
    parts = [
        common_pb2.ContentPart(text=BEFORE),
        common_pb2.ContentPart(image=image),
        common_pb2.ContentPart(text=AFTER),
    ]
    request = generation_pb2.GenerateRequest(
        chat=common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", parts=parts)]),
        sampling=common_pb2.SamplingOptions(temperature=0.0),
        stopping=common_pb2.StoppingOptions(max_tokens=NEW_TOKENS),
    )
    reply = gen.Generate(request, timeout=120)
    assert list(reply.choices[0].token_ids) == _offline(offline, smollm_tokenizer, png)[0]
    assert reply.usage.prompt_tokens == len(_expected_ids(smollm_tokenizer)) - 1 + 30
    harness.assert_idle()
