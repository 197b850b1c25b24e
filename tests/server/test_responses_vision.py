"""Image inputs on the Responses API (#33): ``input_image`` parts (a base64 ``data:`` URL in
``image_url``) through the real ``openai`` SDK's ``client.responses.create``, on a tiny random
LLaVA behind the gRPC server and the REST shim. The answer equals chat's for the same text and
image (chat's equals the offline engine's: ``test_vision_serve.py``); a continued response keeps
the image in its conversation and hits the image's KV blocks; the limits, undecodable bytes,
remote URLs, ``file_id`` and images outside user messages are 400s naming the part; a
``function_call_output`` may hold ``input_image`` parts (OpenAI's schema allows them);
(``input.<item>.content.<part>``, counted past ``instructions`` and the stored history) and the
limit, as chat's are."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from PIL import Image
from rest_harness import RestHarness
from server_harness import ServerHarness
from tiny_llava import save_tiny_llava, synthetic_image

from tokenwire.server.grpc.convert import Limits
from tokenwire.server.grpc.images import ImageLimits

IMAGE_TOKEN = 4  # one of SmolLM2's special tokens: no template or user text produces it
PATCHES = 16  # (32 // 8) ** 2
NEW_TOKENS = 6
LIMITS = ImageLimits(max_images=2, max_bytes=64 << 10, max_pixels=100_000)
BEFORE, AFTER = "Look at this: ", " What is it?"


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _image(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    return _png(synthetic_image(seed, size))


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def harness_model(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any) -> Path:
    path = tmp_path_factory.mktemp("llava-responses")
    save_tiny_llava(path, len(smollm_tokenizer), IMAGE_TOKEN, max_position=512)
    smollm_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(
        limits=Limits(images=LIMITS), max_model_len=512, max_num_batched_tokens=512, in_process=True
    )


def _input(*images: bytes, before: str = BEFORE) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "input_text", "text": before}]
    parts += [{"type": "input_image", "image_url": _data_url(png)} for png in images]
    parts.append({"type": "input_text", "text": AFTER})
    return [{"role": "user", "content": parts}]


def _create(client: openai.OpenAI, input: Any, **kwargs: Any) -> Any:
    return client.responses.create(
        model="tiny", input=input, temperature=0.0, max_output_tokens=NEW_TOKENS, **kwargs
    )


def _chat_text(client: openai.OpenAI, png: bytes) -> str:
    content = [
        {"type": "text", "text": BEFORE},
        {"type": "image_url", "image_url": {"url": _data_url(png)}},
        {"type": "text", "text": AFTER},
    ]
    completion = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],  # type: ignore[list-item,misc]
        temperature=0.0,
        max_tokens=NEW_TOKENS,
    )
    return str(completion.choices[0].message.content)


def test_input_image_answers_as_chat_does(
    openai_client: openai.OpenAI, harness: ServerHarness
) -> None:
    chat = _chat_text(openai_client, _image(1))
    first = _create(openai_client, _input(_image(1)), store=False)
    assert first.output_text == chat and first.output_text
    # the chat of the same image ran just before: its blocks, the image's included, are hits
    assert first.usage.input_tokens_details.cached_tokens >= PATCHES
    other = _create(openai_client, _input(_image(7)), store=False)
    assert other.output_text == _chat_text(openai_client, _image(7))
    # another image, same text: no hit past the text before it
    assert (
        other.usage.input_tokens_details.cached_tokens
        < first.usage.input_tokens_details.cached_tokens
    )
    assert first.usage.input_tokens == other.usage.input_tokens
    stream = openai_client.responses.create(
        model="tiny",
        input=_input(_image(1)),  # type: ignore[arg-type]
        temperature=0.0,
        max_output_tokens=NEW_TOKENS,
        store=False,
        stream=True,
    )
    done = [e for e in stream if e.type in ("response.completed", "response.incomplete")]
    assert len(done) == 1 and done[0].response.output_text == chat
    harness.assert_idle()


def test_a_continued_response_keeps_the_image(
    openai_client: openai.OpenAI, harness: ServerHarness
) -> None:
    first = _create(openai_client, _input(_image(3)), instructions="Be brief.")
    assert first.usage.input_tokens > PATCHES
    follow = _create(
        openai_client, "And its colour?", previous_response_id=first.id, instructions="Be brief."
    )
    # the whole first prompt, the image's run included, is a hit: the image was re-sent
    # with the history and hashed the same
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    openai_client.responses.delete(follow.id)
    openai_client.responses.delete(first.id)
    harness.assert_idle()


def _tool_turn(output: Any) -> list[dict[str, Any]]:
    """A user asks, the model called ``screenshot``, and ``output`` is its result."""
    return [
        {"role": "user", "content": "What is on the screen?"},
        {"type": "function_call", "call_id": "call_1", "name": "screenshot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": output},
    ]


def test_a_function_call_output_holds_an_image(
    openai_client: openai.OpenAI, harness: ServerHarness
) -> None:
    """OpenAI's schema lets a tool's output be ``input_text`` and ``input_image`` parts: the
    image's run of placeholders lands in the tool message, and its pixels count (another
    image, other hashes: no cache hit past the text before it)."""
    text = [{"type": "input_text", "text": "Here it is."}]

    def image(seed: int) -> dict[str, Any]:
        return {"type": "input_image", "image_url": _data_url(_image(seed))}

    plain = _create(openai_client, _tool_turn(text), store=False)
    first = _create(openai_client, _tool_turn([*text, image(1)]), store=False)
    again = _create(openai_client, _tool_turn([*text, image(1)]), store=False)
    other = _create(openai_client, _tool_turn([*text, image(7)]), store=False)
    # one <image> token where the part stood, expanded to the image's 16 placeholders
    assert first.usage.input_tokens == plain.usage.input_tokens + PATCHES
    assert again.output_text == first.output_text and first.output_text
    assert again.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    assert other.usage.input_tokens == first.usage.input_tokens
    assert (
        other.usage.input_tokens_details.cached_tokens
        < again.usage.input_tokens_details.cached_tokens
    )
    harness.assert_idle()


def test_a_bad_image_in_a_function_call_output_names_its_part(rest: RestHarness) -> None:
    bad = {"type": "input_image", "image_url": _data_url(b"not an image at all")}
    body = {"model": "tiny", "input": _tool_turn([{"type": "input_text", "text": "x"}, bad])}
    r = httpx.post(f"{rest.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input.2.output.1" and "not a decodable image" in error["message"]
    # chat's tool messages stay text-only, as OpenAI's chat schema has them
    tool = {"role": "tool", "tool_call_id": "call_1", "content": [bad]}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}, tool]}
    r = httpx.post(f"{rest.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and "messages.1.content" in r.json()["error"]["message"], r.text


def _bomb() -> bytes:
    """A few kilobytes of PNG declaring 3000 x 3000 pixels."""
    return _png(Image.new("L", (3000, 3000)))


BAD = [  # (the image parts' bytes, what the error names)
    ([_image(1)] * 3, "--max-images-per-request"),
    ([_image(2, (200, 200))], "--max-image-bytes"),
    ([_bomb()], "--max-image-pixels"),
    ([b"not an image at all"], "not a decodable image"),
]


@pytest.mark.parametrize(("images", "names"), BAD, ids=["count", "bytes", "pixels", "garbage"])
def test_limits_and_bad_images_are_400_naming_the_part(
    openai_client: openai.OpenAI, images: list[bytes], names: str, harness: ServerHarness
) -> None:
    items = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        *_input(*images),
    ]
    with pytest.raises(openai.BadRequestError) as err:
        _create(openai_client, items, instructions="Be brief.")
    error = err.value.body
    assert isinstance(error, dict) and names in error["message"]
    # the system message and two items come first in the chat: the name is the input's
    assert str(error["param"]).startswith("input.2.content.")
    assert int(str(error["param"]).rsplit(".", 1)[1]) >= 1
    harness.assert_idle()


def _post(rest: RestHarness, content: list[dict[str, Any]], role: str = "user") -> dict[str, Any]:
    body = {"model": "tiny", "input": [{"role": role, "content": content}]}
    r = httpx.post(f"{rest.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error: dict[str, Any] = r.json()["error"]
    return error


def test_urls_files_and_roles_are_refused(rest: RestHarness) -> None:
    remote = _post(rest, [{"type": "input_image", "image_url": "https://example.com/cat.png"}])
    assert remote["param"] == "input.0.content.0" and "not fetched" in remote["message"]
    text = {"type": "input_text", "text": "hi"}
    bad = _post(rest, [text, {"type": "input_image", "image_url": "data:image/png;base64,%%"}])
    assert bad["param"] == "input.0.content.1" and "base64" in bad["message"]
    missing = _post(rest, [{"type": "input_image", "detail": "auto"}])
    assert missing["param"] == "input.0.content.0" and "image_url" in missing["message"]
    file_id = _post(rest, [{"type": "input_image", "file_id": "file-123"}])
    assert file_id["param"] == "input.0.content.0.file_id" and "inline" in file_id["message"]
    image = {"type": "input_image", "image_url": _data_url(_image(1))}
    assistant = _post(rest, [image], role="assistant")
    assert assistant["param"] == "input.0.role" and "user" in assistant["message"]


@pytest.fixture(scope="module")
def text_only(tiny_model_with_tokenizer: Path) -> Iterator[RestHarness]:
    harness = ServerHarness(tiny_model_with_tokenizer, in_process=True).start()
    rest = RestHarness(harness).start()
    yield rest
    rest.stop()
    harness.stop()


def test_a_text_only_model_refuses_input_image(text_only: RestHarness) -> None:
    image = {"type": "input_image", "image_url": _data_url(_image(1))}
    error = _post(text_only, [{"type": "input_text", "text": "hi"}, image])
    assert error["param"] == "input.0.content.1"
    assert "takes no image inputs" in error["message"]
