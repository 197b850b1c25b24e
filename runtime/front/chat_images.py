"""A chat whose user messages hold images: content parts -> token ids and ``ImageInput``s.

A message's ``content`` may be a list of parts, ``{"type": "text", "text": ...}`` and
``{"type": "image", "data": <encoded bytes>, "part": <the request field, for errors>}``. Each
image becomes a marker in the message's text, a fresh random one per render (a client cannot
spell it), and the chat renders as plain text around it: every marker becomes the model's
image token, exactly where its part stood, and the model's ``ImagePrompter`` then expands it
into the image's run of placeholders and processes the pixels (transformers' image
processor). Every step is blocking (decode, template, tokenizer, image processor): callers run
``render_chat_images`` on a thread, never on an event loop. A model without an image processor
refuses images, naming the first image's part. A model whose chat template puts tokens around
an image (Qwen-VL's ``<|vision_start|>`` and ``<|vision_end|>``) gets them around each marker.
With a ``ProcessedImageCache`` (``front/processed_images.py``), an image whose bytes an earlier
render processed is taken from it, neither decoded nor processed again (a session's later
turns re-render its whole transcript); the rest are decoded and processed as before (in one
processor call) and kept there.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.image_decode import decode_image
from tokenwire.runtime.front.processed_images import ProcessedImageCache, image_key
from tokenwire.runtime.front.tokenizer import apply_chat_template
from tokenwire.runtime.multimodal import ImageInput

if TYPE_CHECKING:
    from tokenwire.runtime.front.images import ImagePrompter
    from tokenwire.runtime.front.tokenizer_type import Tokenizer

__all__ = ["ChatImage", "ImageInput", "chat_images", "has_images", "render_chat_images"]


@dataclass(frozen=True)
class ChatImage:
    """One image part of a chat: its encoded bytes and the request field that carried it."""

    data: bytes
    part: str


def has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) for m in messages)


def chat_images(messages: Sequence[Mapping[str, Any]]) -> list[ChatImage]:
    """Every image part of the chat, in prompt order."""
    return [
        ChatImage(p["data"], p["part"])
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if p.get("type") == "image"
    ]


def _with_markers(messages: Sequence[Mapping[str, Any]], marker: str) -> list[dict[str, Any]]:
    """The chat with each list content flattened to text, each image part a marker."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            text = "".join(marker if p.get("type") == "image" else p["text"] for p in content)
            out.append({**m, "content": text})
        else:
            out.append(dict(m))
    return out


def render_chat_images(
    tokenizer: Tokenizer,
    prompter: ImagePrompter | None,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    max_pixels: int,
    template_kwargs: Mapping[str, Any] | None = None,
    cache: ProcessedImageCache | None = None,
    cache_salt: str | None = None,
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """(prompt ids with each image's placeholder run, the images' inputs); ``cache``: what
    earlier renders processed (an image found there is neither decoded nor processed), for
    requests of the same ``cache_salt`` only."""
    images = chat_images(messages)
    if prompter is None:
        where = images[0].part if images else "messages"
        raise ParameterError(where, "this model takes no image inputs (not a vision model)")
    use = cache if cache is not None and cache.enabled and images else None
    keys = [image_key(image.data, max_pixels, cache_salt) for image in images] if use else []
    known = [use.get(key) for key in keys] if use else [None] * len(images)
    decoded = [
        decode_image(image.data, image.part, max_pixels)
        for image, hit in zip(images, known, strict=True)
        if hit is None
    ]
    marker = f"\ue000image-{secrets.token_hex(8)}\ue001"
    around = prompter.spec.chat_text_around  # Gemma 3: "\n\n", as its processor adds
    ids = apply_chat_template(
        tokenizer,
        _with_markers(messages, around + marker + around),
        tools,
        template_kwargs=template_kwargs,
        image=(marker, prompter.spec.marker),
    )
    ids = _tokens_around(ids, prompter)
    prompter.check_count(ids, len(images))
    made = iter(prompter.process(decoded) if decoded else [])
    processed = [next(made) if hit is None else hit for hit in known]
    if use:
        for key, hit, image in zip(keys, known, processed, strict=True):
            if hit is None:
                use.put(key, image)
    return prompter.place(ids, processed)


def _tokens_around(ids: list[int], prompter: ImagePrompter) -> list[int]:
    """Each image marker token between the chat's tokens around it (Qwen-VL's
    ``<|vision_start|>``, ``<|vision_end|>``)."""
    before, after = prompter.spec.chat_tokens_around
    if not before and not after:
        return ids
    out: list[int] = []
    for t in ids:
        out.extend([*before, t, *after] if t == prompter.spec.marker else [t])
    return out
