"""Images through the typed Python clients (#33): a message's ``content`` as parts, strings
and ``ImagePart``s (from bytes with a MIME type, sniffed, or from a file), against a real server
on a tiny random LLaVA. The sync client's greedy tokens equal the offline engine's for the same
prompt ids and image; the async stream says the same; the server's image limits come back as
``InvalidArgumentError`` naming the part and the limit; a part of another type is a
``TypeError`` before any call."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from server_harness import ServerHarness
from tiny_llava import save_tiny_llava, synthetic_image

from tokenwire.clients import results as r
from tokenwire.clients.async_client import AsyncClient
from tokenwire.clients.client import Client
from tokenwire.clients.content import ImagePart, chat_input
from tokenwire.clients.convert import assemble
from tokenwire.clients.errors import InvalidArgumentError
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.server.grpc.convert import Limits
from tokenwire.server.grpc.images import ImageLimits

IMAGE_TOKEN = 4  # one of SmolLM2's special tokens: no template or user text produces it
NEW_TOKENS = 6
BEFORE, AFTER = "Look at this: ", " What is it?"


def _image(seed: int, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    synthetic_image(seed, (40, 48)).save(out, format=fmt)
    return out.getvalue()


@pytest.fixture(scope="module")
def harness_model(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any) -> Path:
    path = tmp_path_factory.mktemp("llava-client")
    save_tiny_llava(path, len(smollm_tokenizer), IMAGE_TOKEN, max_position=512)
    smollm_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    limits = Limits(images=ImageLimits(max_images=1, max_bytes=64 << 10, max_pixels=100_000))
    return dict(limits=limits, max_model_len=512, max_num_batched_tokens=512, in_process=True)


def _offline_tokens(model: Path, tokenizer: Any, png: bytes) -> list[int]:
    """The offline engine on the prompt the server should build (the template's render, the
    image token where the part stood; tokenized independently of the server's code)."""
    marker = "@@IMAGE@@"
    messages = [{"role": "user", "content": BEFORE + marker + AFTER}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    head, tail = text.split(marker)

    def encode(piece: str) -> list[int]:
        return list(tokenizer(piece, add_special_tokens=False)["input_ids"])

    prompt = {
        "prompt_token_ids": [*encode(head), IMAGE_TOKEN, *encode(tail)],
        "multi_modal_data": {"image": [Image.open(io.BytesIO(png)).convert("RGB")]},
    }
    llm = LLM(str(model), device="cpu", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_image_parts_match_the_offline_engine(
    harness: ServerHarness, harness_model: Path, smollm_tokenizer: Any, tmp_path: Path
) -> None:
    png = _image(1)
    (tmp_path / "photo.png").write_bytes(png)
    from_file = ImagePart.from_file(tmp_path / "photo.png")
    assert from_file == ImagePart.from_bytes(png) == ImagePart(png, "image/png")
    messages = [{"role": "user", "content": [BEFORE, from_file, AFTER]}]
    with Client(harness.target, timeout=120) as client:
        reply = client.generate(messages=messages, temperature=0.0, max_tokens=NEW_TOKENS)
        other = client.generate(
            messages=[
                {"role": "user", "content": [BEFORE, ImagePart.from_bytes(_image(7)), AFTER]}
            ],
            temperature=0.0,
            max_tokens=NEW_TOKENS,
        )
    expected = _offline_tokens(harness_model, smollm_tokenizer, png)
    assert reply.choices[0].token_ids == expected
    assert reply.usage.prompt_tokens == other.usage.prompt_tokens
    assert reply.usage.prompt_tokens > 16  # the image's 16 placeholders are in the prompt

    async def streamed() -> list[int]:
        async with AsyncClient(harness.target, timeout=120) as client:
            events = [
                e
                async for e in client.stream(
                    messages=messages, temperature=0.0, max_tokens=NEW_TOKENS
                )
            ]
        assert any(isinstance(e, r.ChoiceEnd) for e in events)
        return assemble(events).choices[0].token_ids

    assert asyncio.run(streamed()) == expected
    harness.assert_idle()


def test_limits_are_invalid_argument_naming_the_part(harness: ServerHarness) -> None:
    two = [ImagePart.from_bytes(_image(1)), ImagePart.from_bytes(_image(2))]
    garbage = ImagePart(b"not an image", "image/png")
    with Client(harness.target, timeout=60) as client:
        with pytest.raises(InvalidArgumentError) as count:
            client.generate(messages=[{"role": "user", "content": ["hi", *two]}], max_tokens=2)
        with pytest.raises(InvalidArgumentError) as bad:
            client.generate(messages=[{"role": "user", "content": ["hi", garbage]}], max_tokens=2)
    assert "--max-images-per-request" in str(count.value)
    assert "chat.messages[0].parts[" in str(count.value)
    assert "not a decodable image" in str(bad.value)
    assert str(bad.value.param).startswith("chat.messages[0].parts[1]")
    harness.assert_idle()


def test_content_parts_convert_in_order_and_refuse_other_types() -> None:
    jpeg = _image(3, "JPEG")
    chat = chat_input(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": ["a", ImagePart.from_bytes(jpeg), "b"]},
        ]
    )
    system, user = chat.messages
    assert system.content == "Be brief." and not system.parts
    assert [p.WhichOneof("part") for p in user.parts] == ["text", "image", "text"]
    assert user.parts[1].image.data == jpeg and user.parts[1].image.mime_type == "image/jpeg"
    assert ImagePart.from_bytes(b"\x00\x01").mime_type == ""
    with pytest.raises(TypeError, match="ImagePart"):
        chat_input([{"role": "user", "content": ["a", b"raw bytes"]}])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="non-empty"):
        ImagePart(b"")
