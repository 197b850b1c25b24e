"""Gemma 3 multimodal served (#33): a tiny random ``Gemma3ForConditionalGeneration``
(SmolLM2's tokenizer and chat template, a SigLIP vision tower) behind the REST shim. The
OpenAI SDK's ``image_url`` part becomes ``<start_of_image>`` where the part stood (with the
blank lines ``Gemma3Processor`` puts around it), expanded by the engine to the image's run;
the greedy tokens equal the offline engine's for the same prompt ids and image (which equal
HF ``generate()``: ``tests/runtime/test_gemma3_mm.py``); a prompt differing only in its image
gets other logprobs and no cache hit past the text before it; the same image again hits
past it. A gRPC ``ImagePart`` (unary and streamed) gives the same tokens as the offline engine,
and a ``json_schema`` structured output over an image prompt gives tokens valid under the
schema (the grammar shapes a random model's answer)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from PIL import Image
from server_harness import ServerHarness
from tiny_gemma3_mm import IMAGE_TOKENS, save_tiny_gemma3_mm
from tiny_llava import synthetic_image

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

# SmolLM2 special tokens no template or user text produces: image, begin and end of image.
IMAGE, BOI, EOI = 4, 5, 6
NEW_TOKENS = 6
BEFORE, AFTER = "Look at this: ", " What is it?"


def _png(seed: int) -> bytes:
    out = io.BytesIO()
    synthetic_image(seed).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def harness_model(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any) -> Path:
    path = tmp_path_factory.mktemp("gemma3-served")
    save_tiny_gemma3_mm(path, len(smollm_tokenizer), 512, (IMAGE, BOI, EOI))
    smollm_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def offline(harness_model: Path) -> Iterator[LLM]:
    yield LLM(str(harness_model), device="cpu", max_model_len=512)


def _expected_ids(tokenizer: Any) -> list[int]:
    """The template's render with ``<start_of_image>`` where the image part stood, with
    ``Gemma3Processor``'s blank lines on each side (tokenized independently of the server's
    code; the special token splits the text, as in HF's processor)."""
    marker = "@@IMAGE@@"
    messages = [{"role": "user", "content": BEFORE + marker + AFTER}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    head, tail = text.split(marker)

    def encode(piece: str) -> list[int]:
        return list(tokenizer(piece, add_special_tokens=False)["input_ids"])

    return [*encode(head + "\n\n"), BOI, *encode("\n\n" + tail)]


def _offline_tokens(llm: LLM, tokenizer: Any, png: bytes) -> list[int]:
    prompt = {
        "prompt_token_ids": _expected_ids(tokenizer),
        "multi_modal_data": {"image": [Image.open(io.BytesIO(png)).convert("RGB")]},
    }
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


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


def test_openai_image_part_matches_the_offline_engine(
    openai_client: openai.OpenAI, offline: LLM, smollm_tokenizer: Any, harness: ServerHarness
) -> None:
    expected_ids = _expected_ids(smollm_tokenizer)
    completion = _chat(openai_client, _png(1))
    # <start_of_image> became itself, the image's run and <end_of_image>.
    assert completion.usage.prompt_tokens == len(expected_ids) + IMAGE_TOKENS + 1
    assert _token_ids(completion) == _offline_tokens(offline, smollm_tokenizer, _png(1))
    other = _chat(openai_client, _png(7))
    assert _token_ids(other) == _offline_tokens(offline, smollm_tokenizer, _png(7))
    assert _logprobs(other) != pytest.approx(_logprobs(completion), abs=1e-3)  # the image counts
    before = expected_ids.index(BOI) + 1
    assert other.usage.prompt_tokens_details.cached_tokens < before
    again = _chat(openai_client, _png(1))
    assert again.usage.prompt_tokens_details.cached_tokens > before
    assert _token_ids(again) == _token_ids(completion)
    assert _logprobs(again) == pytest.approx(_logprobs(completion), abs=1e-4)
    harness.assert_idle()


def _grpc_request(
    png: bytes, max_tokens: int = NEW_TOKENS, output: common_pb2.OutputOptions | None = None
) -> generation_pb2.GenerateRequest:
    image = common_pb2.ImagePart(data=png, mime_type="image/png")
    parts = [
        common_pb2.ContentPart(text=BEFORE),
        common_pb2.ContentPart(image=image),
        common_pb2.ContentPart(text=AFTER),
    ]
    message = common_pb2.ChatMessage(role="user", parts=parts)
    return generation_pb2.GenerateRequest(
        chat=common_pb2.ChatInput(messages=[message]),
        sampling=common_pb2.SamplingOptions(temperature=0.0),
        stopping=common_pb2.StoppingOptions(max_tokens=max_tokens),
        output=output,
    )


def test_grpc_image_part_matches_the_offline_engine(
    gen: generation_pb2_grpc.GenerationServiceStub,
    offline: LLM,
    smollm_tokenizer: Any,
    harness: ServerHarness,
) -> None:
    png = _png(3)
    expected = _offline_tokens(offline, smollm_tokenizer, png)
    reply = gen.Generate(_grpc_request(png), timeout=120)
    assert list(reply.choices[0].token_ids) == expected
    assert reply.usage.prompt_tokens == len(_expected_ids(smollm_tokenizer)) + IMAGE_TOKENS + 1
    streamed = [
        token
        for event in gen.GenerateStream(_grpc_request(png), timeout=120)
        if event.HasField("delta")
        for token in event.delta.token_ids
    ]
    assert streamed == expected
    harness.assert_idle()


COLOUR = {
    "type": "object",
    "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}


def test_json_schema_over_an_image_prompt(
    gen: generation_pb2_grpc.GenerationServiceStub, smollm_tokenizer: Any, harness: ServerHarness
) -> None:
    structured = common_pb2.StructuredOutput(json_schema=json.dumps(COLOUR))
    output = common_pb2.OutputOptions(structured_output=structured)
    for seed in (1, 7):
        reply = gen.Generate(_grpc_request(_png(seed), 60, output), timeout=120)
        choice = reply.choices[0]
        assert choice.finish_reason != common_pb2.FINISH_REASON_LENGTH, choice  # JSON closed
        text = smollm_tokenizer.decode(list(choice.token_ids), skip_special_tokens=True)
        assert text == choice.text
        jsonschema.validate(json.loads(choice.text), COLOUR)
    harness.assert_idle()
