"""OpenAI chat content parts: ``text`` and ``image_url``, and their ``tokenwire.v1`` form.

An ``image_url`` part's URL must be a ``data:`` URL with base64 content
(``data:image/png;base64,...``): the shim decodes it into an ``ImagePart`` (bytes and MIME
type) of the gRPC ``ChatMessage.parts``, in the same order as the parts, so a gRPC error about
``chat.messages[i].parts[j]`` names ``messages.i.content.j`` back. Remote ``http(s)`` URLs
are fetched only for hosts listed in ``--allowed-media-domains`` (``remote_images`` inlines
them as ``data:`` URLs before this runs); any other reaching here is refused with a 400 naming
the flag. Whether the model takes images, and every limit (count, bytes,
pixels), is the gRPC server's call.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenwire.server.rest.errors import invalid
from tokenwire.v1 import common_pb2

# data:[<mime>][;param=value]*;base64,<data>
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?:;[\w.+-]+=[^;,]*)*;base64,", re.I)


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImageUrl(_Part):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the processor decides


class ImageUrlPart(_Part):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]


def has_images(parts: list[TextPart | ImageUrlPart]) -> bool:
    return any(isinstance(part, ImageUrlPart) for part in parts)


def image_part(url: str, param: str) -> common_pb2.ImagePart:
    """A ``data:`` URL's image; 400 naming ``param`` for any other URL or bad base64."""
    found = _DATA_URL.match(url)
    if found is None:
        if url[:8].lower().startswith(("http://", "https://")):
            raise invalid(
                param,
                "remote image URLs are not fetched by this server (no --allowed-media-domains); "
                "send the image inline as a data: URL (data:image/png;base64,...)",
                "unsupported_value",
            )
        raise invalid(param, "an image URL must be a base64 data: URL (data:image/png;base64,...)")
    try:
        data = base64.b64decode(url[found.end() :], validate=True)
    except (binascii.Error, ValueError):
        raise invalid(param, "the data: URL's base64 content does not decode") from None
    return common_pb2.ImagePart(data=data, mime_type=found.group("mime") or "")


def message_parts(
    parts: list[TextPart | ImageUrlPart], index: int
) -> tuple[list[common_pb2.ContentPart], dict[str, str]]:
    """A message's content parts as gRPC parts, and the proto -> OpenAI names of the image
    parts (for errors)."""
    out: list[common_pb2.ContentPart] = []
    names: dict[str, str] = {}
    for j, part in enumerate(parts):
        if isinstance(part, TextPart):
            out.append(common_pb2.ContentPart(text=part.text))
            continue
        param = f"messages.{index}.content.{j}"
        out.append(common_pb2.ContentPart(image=image_part(part.image_url.url, param)))
        names[f"chat.messages[{index}].parts[{j}]"] = param
        names[f"chat.messages[{index}].parts[{j}].image"] = param
    return out, names


__all__ = ["ContentPart", "ImageUrlPart", "TextPart", "has_images", "image_part", "message_parts"]
