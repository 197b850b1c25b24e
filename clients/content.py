"""Chat message content for the typed clients: text, or ordered parts with images.

A message's ``content`` is a string, or a sequence of parts, each a string (text) or an
``ImagePart`` (image bytes and MIME type; a vision-language model only, others refuse it with
``InvalidArgumentError``). Parts become ``ChatMessage.parts`` in the same order, so each image
enters the prompt where its part stands::

    png = ImagePart.from_file("cat.png")
    client.generate(messages=[{"role": "user", "content": ["What is this? ", png]}])
"""

from __future__ import annotations

import mimetypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from tokenwire.v1 import common_pb2 as pb

# Magic numbers of the formats an image processor reads, for from_bytes without a type.
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


@dataclass(frozen=True)
class ImagePart:
    """An image in a chat message. ``mime_type`` is informational (the server sniffs the
    bytes); the server's limits (count, bytes, pixels) apply."""

    data: bytes
    mime_type: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.data, bytes) or not self.data:
            raise ValueError("ImagePart.data must be non-empty bytes")

    @classmethod
    def from_bytes(cls, data: bytes, mime_type: str | None = None) -> ImagePart:
        """``mime_type`` defaults to the one the bytes' signature names (or none)."""
        if mime_type is None:
            mime_type = next((m for sig, m in _SIGNATURES if data.startswith(sig)), "")
            if not mime_type and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
                mime_type = "image/webp"
        return cls(data, mime_type)

    @classmethod
    def from_file(cls, path: str | Path) -> ImagePart:
        """The file's bytes; the MIME type from its name, else from its signature."""
        data = Path(path).read_bytes()
        guessed, _ = mimetypes.guess_type(str(path))
        return cls.from_bytes(data, guessed if guessed and guessed.startswith("image/") else None)

    def to_proto(self) -> pb.ContentPart:
        return pb.ContentPart(image=pb.ImagePart(data=self.data, mime_type=self.mime_type))


Part: TypeAlias = str | ImagePart
Content: TypeAlias = str | Sequence[Part]
Message: TypeAlias = Mapping[str, Content]
Messages: TypeAlias = Sequence[Message]


def message_proto(message: Message) -> pb.ChatMessage:
    """One message: ``role`` and ``content`` (a string, or parts with images)."""
    role, content = message["role"], message.get("content", "")
    if not isinstance(role, str):
        raise TypeError("a message's role must be a string")
    if isinstance(content, str):
        return pb.ChatMessage(role=role, content=content)
    out = pb.ChatMessage(role=role)
    for part in content:
        if isinstance(part, ImagePart):
            out.parts.append(part.to_proto())
        elif isinstance(part, str):
            out.parts.append(pb.ContentPart(text=part))
        else:
            raise TypeError(f"a content part is a str or an ImagePart, not {type(part).__name__}")
    return out


def chat_input(messages: Messages) -> pb.ChatInput:
    return pb.ChatInput(messages=[message_proto(m) for m in messages])


__all__ = ["Content", "ImagePart", "Message", "Messages", "Part", "chat_input", "message_proto"]
