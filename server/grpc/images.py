"""Image parts of a chat (``ChatMessage.parts``) and the server's limits on them.

``message_content`` turns a message's parts into the runtime's content list (text parts and
``{"type": "image", "data", "part"}``, see ``runtime/front/chat_images.py``); only user
messages and tool messages (a Responses ``function_call_output``'s images) carry images.
``check_images`` applies the cheap limits before any decoding: the number of images in a
request (``--max-images-per-request``) and each image's encoded size (``--max-image-bytes``);
the pixel limit (``--max-image-pixels``) is checked against the image's header on the
tokenizer pool's thread, before the image is decompressed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.chat_images import ChatImage
from tokenwire.runtime.front.processed_images import DEFAULT_CACHE_BYTES
from tokenwire.v1 import common_pb2

DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_IMAGE_BYTES = 10 << 20  # under the gRPC message limit (16 MiB by default)
DEFAULT_MAX_IMAGE_PIXELS = 1 << 25  # 33.5 megapixels, under Pillow's own bomb threshold


@dataclass(frozen=True)
class ImageLimits:
    """``--max-images-per-request``, ``--max-image-bytes``, ``--max-image-pixels``, and
    ``--mm-processor-cache-bytes`` (the tokenizer pool's processed images; 0: none kept)."""

    max_images: int = DEFAULT_MAX_IMAGES
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    processor_cache_bytes: int = DEFAULT_CACHE_BYTES

    def __post_init__(self) -> None:
        if self.max_images < 0:
            raise ValueError("--max-images-per-request must be >= 0")
        if self.max_bytes <= 0:
            raise ValueError("--max-image-bytes must be > 0")
        if self.max_pixels <= 0:
            raise ValueError("--max-image-pixels must be > 0")
        if self.processor_cache_bytes < 0:
            raise ValueError("--mm-processor-cache-bytes must be >= 0")


def message_content(m: common_pb2.ChatMessage, index: int) -> str | list[dict[str, Any]]:
    """A message's content: ``content``, else its parts (text joined when there is no
    image; else the runtime's part list)."""
    where = f"chat.messages[{index}]"
    if not m.parts:
        return m.content
    if m.content:
        raise ParameterError(where, "content and parts are exclusive: send one of them")
    return parts_content(m.parts, m.role, where)


def parts_content(
    parts: Sequence[common_pb2.ContentPart], role: str, where: str
) -> str | list[dict[str, Any]]:
    """Ordered parts of a ``role`` message (errors name ``where.parts[j]``): their text
    joined when there is no image, else the runtime's part list."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        kind = part.WhichOneof("part")
        if kind == "text":
            out.append({"type": "text", "text": part.text})
        elif kind == "image":
            if role not in ("user", "tool"):
                raise ParameterError(
                    f"{where}.parts[{j}].image", "only user and tool messages hold images"
                )
            out.append({"type": "image", "data": part.image.data, "part": f"{where}.parts[{j}]"})
        else:
            raise ParameterError(f"{where}.parts[{j}]", "a part needs text or image")
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def check_images(images: list[ChatImage], limits: ImageLimits) -> None:
    """The request's image count and each image's size, before anything is decoded."""
    if len(images) > limits.max_images:
        raise ParameterError(
            images[limits.max_images].part,
            f"the request has {len(images)} images, above the server's limit of "
            f"{limits.max_images} per request (--max-images-per-request)",
        )
    for image in images:
        if len(image.data) > limits.max_bytes:
            raise ParameterError(
                image.part,
                f"the image is {len(image.data)} bytes, above the server's limit of "
                f"{limits.max_bytes} (--max-image-bytes)",
            )
        if not image.data:
            raise ParameterError(image.part, "the image is empty")
