"""Image inputs served end to end (#33): a tiny random LLaVA (SmolLM2's tokenizer and chat
template, a CLIP vision tower) behind the gRPC server and the REST shim. The OpenAI SDK's
``image_url`` part (a base64 ``data:`` URL) and a gRPC ``ImagePart`` give the same greedy
tokens as the offline engine given the same prompt ids and image; two prompts that differ only
in the image share no prefix-cache block past the text before it; the limits (images per
request, bytes, pixels read from the header: a small PNG declaring a huge canvas), undecodable
bytes and remote URLs are 400 / INVALID_ARGUMENT naming the part and the limit; a text-only
model refuses image parts."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from PIL import Image
from rest_harness import RestHarness
from server_harness import ServerHarness
from tiny_llava import save_tiny_llava, synthetic_image

from tokenwire.runtime.front.frontend import Frontend
from tokenwire.runtime.front.images import ImagePrompter
from tokenwire.runtime.front.processed_images import ProcessedImageCache
from tokenwire.runtime.front.tokenizer import load_tokenizer
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.multimodal import ImageInput
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.server.grpc.convert import Limits
from tokenwire.server.grpc.images import ImageLimits
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

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
    path = tmp_path_factory.mktemp("llava-served")
    save_tiny_llava(path, len(smollm_tokenizer), IMAGE_TOKEN, max_position=512)
    smollm_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(limits=Limits(images=LIMITS), max_model_len=512, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def offline(harness_model: Path) -> LLM:
    return LLM(str(harness_model), device="cpu", max_model_len=512)


def _expected_ids(tokenizer: Any) -> list[int]:
    """The prompt the server should build: the template's render, the image's token where
    its part stood (tokenized independently of the server's code)."""
    marker = "@@IMAGE@@"
    messages = [{"role": "user", "content": BEFORE + marker + AFTER}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    head, tail = text.split(marker)

    def encode(piece: str) -> list[int]:
        return list(tokenizer(piece, add_special_tokens=False)["input_ids"])

    return [*encode(head), IMAGE_TOKEN, *encode(tail)]


def _offline_tokens(llm: LLM, tokenizer: Any, png: bytes) -> list[int]:
    prompt = {
        "prompt_token_ids": _expected_ids(tokenizer),
        "multi_modal_data": {"image": [Image.open(io.BytesIO(png)).convert("RGB")]},
    }
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def _chat_parts(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _sdk_chat(client: openai.OpenAI, messages: list[dict[str, Any]]) -> Any:
    return client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        temperature=0.0,
        max_tokens=NEW_TOKENS,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
    )


def _token_ids(completion: Any) -> list[int]:
    return [int(t.token.removeprefix("token_id:")) for t in completion.choices[0].logprobs.content]


def test_openai_image_part_matches_the_offline_engine(
    openai_client: openai.OpenAI, offline: LLM, smollm_tokenizer: Any, harness: ServerHarness
) -> None:
    png = _image(1)
    messages = _chat_parts(
        {"type": "text", "text": BEFORE},
        _image_part(_data_url(png)),
        {"type": "text", "text": AFTER},
    )
    completion = _sdk_chat(openai_client, messages)
    assert completion.usage.prompt_tokens == len(_expected_ids(smollm_tokenizer)) - 1 + PATCHES
    assert _token_ids(completion) == _offline_tokens(offline, smollm_tokenizer, png)
    # Another image, same text: other tokens, and no cache hit past the text before it.
    other = _sdk_chat(
        openai_client,
        _chat_parts(
            messages[0]["content"][0], _image_part(_data_url(_image(7))), messages[0]["content"][2]
        ),
    )
    assert _token_ids(other) == _offline_tokens(offline, smollm_tokenizer, _image(7))
    assert _token_ids(other) != _token_ids(completion)
    before = len(_expected_ids(smollm_tokenizer)[: _expected_ids(smollm_tokenizer).index(4)])
    cached = other.usage.prompt_tokens_details.cached_tokens
    assert cached <= before
    again = _sdk_chat(openai_client, messages)
    assert again.usage.prompt_tokens_details.cached_tokens > before
    assert _token_ids(again) == _token_ids(completion)
    harness.assert_idle()


def test_a_streamed_image_chat_says_the_same(openai_client: openai.OpenAI) -> None:
    url = _data_url(_image(11))
    messages = _chat_parts({"type": "text", "text": BEFORE}, _image_part(url))
    whole = openai_client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        temperature=0.0,
        max_tokens=NEW_TOKENS,
    )
    stream = openai_client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        temperature=0.0,
        max_tokens=NEW_TOKENS,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content


def test_a_re_sent_conversation_reuses_its_processed_image(
    openai_client: openai.OpenAI, harness: ServerHarness
) -> None:
    """A REST client re-sends the whole conversation each request (``--mm-processor-cache-bytes``,
    on by default): the second request's image is neither decoded nor processed again, and the
    re-sent first request answers as before."""
    cache = harness.server.tokenizers.processed_images
    assert cache is not None
    messages = _chat_parts({"type": "text", "text": BEFORE}, _image_part(_data_url(_image(23))))
    start = cache.stats()
    first = _sdk_chat(openai_client, messages)
    follow_up = [
        *messages,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And what else?"},
    ]
    _sdk_chat(openai_client, follow_up)
    again = _sdk_chat(openai_client, messages)
    end = cache.stats()
    assert (end.misses - start.misses, end.hits - start.hits) == (1, 2)
    assert _token_ids(again) == _token_ids(first)
    harness.assert_idle()


def _grpc_request(*parts: common_pb2.ContentPart) -> generation_pb2.GenerateRequest:
    message = common_pb2.ChatMessage(role="user", parts=list(parts))
    return generation_pb2.GenerateRequest(
        chat=common_pb2.ChatInput(messages=[message]),
        sampling=common_pb2.SamplingOptions(temperature=0.0),
        stopping=common_pb2.StoppingOptions(max_tokens=NEW_TOKENS),
    )


def _grpc_image(data: bytes) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(image=common_pb2.ImagePart(data=data, mime_type="image/png"))


def test_grpc_image_part_matches_the_offline_engine(
    gen: generation_pb2_grpc.GenerationServiceStub, offline: LLM, smollm_tokenizer: Any
) -> None:
    png = _image(3, (64, 30))
    request = _grpc_request(
        common_pb2.ContentPart(text=BEFORE), _grpc_image(png), common_pb2.ContentPart(text=AFTER)
    )
    reply = gen.Generate(request, timeout=120)
    assert list(reply.choices[0].token_ids) == _offline_tokens(offline, smollm_tokenizer, png)


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
def test_limits_and_bad_images_are_400(
    http_client: Any, images: list[bytes], names: str, harness: ServerHarness
) -> None:
    parts = [_image_part(_data_url(png)) for png in images]
    body = {"model": "tiny", "messages": _chat_parts({"type": "text", "text": "hi"}, *parts)}
    r = http_client.post("/v1/chat/completions", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and names in error["message"]
    assert error["param"].startswith("messages.0.content.")
    harness.assert_idle()


@pytest.mark.parametrize(("images", "names"), BAD, ids=["count", "bytes", "pixels", "garbage"])
def test_limits_and_bad_images_are_invalid_argument(
    gen: generation_pb2_grpc.GenerationServiceStub, images: list[bytes], names: str
) -> None:
    request = _grpc_request(common_pb2.ContentPart(text="hi"), *map(_grpc_image, images))
    with pytest.raises(grpc.RpcError) as err:
        gen.Generate(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert names in err.value.details() and "chat.messages[0].parts[" in err.value.details()


def test_remote_and_malformed_urls_are_400(http_client: Any) -> None:
    def post(url: str) -> dict[str, Any]:
        body = {"model": "tiny", "messages": _chat_parts(_image_part(url))}
        r = http_client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400
        error: dict[str, Any] = r.json()["error"]
        assert error["param"] == "messages.0.content.0"
        return error

    assert "not fetched" in post("https://example.com/cat.png")["message"]
    assert "data:" in post("ftp://example.com/cat.png")["message"]
    assert "base64" in post("data:image/png;base64,%%%")["message"]


@pytest.fixture(scope="module")
def text_only(tiny_model_with_tokenizer: Path) -> Iterator[RestHarness]:
    harness = ServerHarness(tiny_model_with_tokenizer, in_process=True).start()
    rest = RestHarness(harness).start()
    yield rest
    rest.stop()
    harness.stop()


def test_a_text_only_model_refuses_image_parts(text_only: RestHarness) -> None:
    import httpx

    body = {
        "model": "tiny",
        "messages": _chat_parts({"type": "text", "text": "hi"}, _image_part(_data_url(_image(1)))),
    }
    r = httpx.post(f"{text_only.url}/v1/chat/completions", json=body, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages.0.content.1"
    assert "takes no image inputs" in error["message"]


class _ThreadRecordingFrontend(Frontend):
    threads: list[int]

    def render_chat_images(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        max_pixels: int,
        template_kwargs: Mapping[str, Any] | None = None,
        cache: ProcessedImageCache | None = None,
        cache_salt: str | None = None,
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        self.threads.append(threading.get_ident())
        return super().render_chat_images(
            messages,
            tools,
            max_pixels=max_pixels,
            template_kwargs=template_kwargs,
            cache=cache,
            cache_salt=cache_salt,
        )


def test_images_are_decoded_off_the_event_loop(harness_model: Path, offline: LLM) -> None:
    front = _ThreadRecordingFrontend(
        load_tokenizer(harness_model),
        vocab_size=1 << 20,
        max_model_len=512,
        images=ImagePrompter.from_model_dir(harness_model),
    )
    front.threads = []
    png = _image(5)
    content = [{"type": "text", "text": BEFORE}, {"type": "image", "data": png, "part": "p"}]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": AFTER}]}]

    async def served() -> tuple[int, list[int], tuple[ImageInput, ...]]:
        pool = TokenizerPool(front, max_prompt_bytes=1 << 20, images=LIMITS)
        try:
            ids, images = await pool.render_chat_images("chat", messages)
        finally:
            pool.shutdown()
        return threading.get_ident(), ids, images

    loop_thread, ids, images = asyncio.run(served())
    assert len(front.threads) == 1 and loop_thread not in front.threads
    assert ids.count(IMAGE_TOKEN) == PATCHES and len(images) == 1
    assert (images[0].offset, images[0].length) == (ids.index(IMAGE_TOKEN), PATCHES)
