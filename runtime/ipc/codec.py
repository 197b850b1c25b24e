"""msgspec (MessagePack) encoding of the front <-> core records; never pickle on a socket.

A frame is ``[tag, payload]``: the tag names the record type, and the payload is decoded
straight into that type (msgspec validates every field's type while decoding), so bytes from
the socket can only ever become one of the declared plain records.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenwire.runtime.engine.messages import (
    AbortRequests,
    AddLoRA,
    AddRequest,
    CheckIdle,
    CoreFailed,
    CoreInput,
    CoreOutput,
    CoreStarted,
    IdleReply,
    LoRAReply,
    ReleaseHolder,
    RemoveLoRA,
    ResetPrefixCache,
    ResetReply,
    Shutdown,
    StepResult,
)

_INPUT_TYPES: tuple[type[Any], ...] = (
    AddRequest,
    AbortRequests,
    ReleaseHolder,
    CheckIdle,
    Shutdown,
    AddLoRA,
    RemoveLoRA,
    ResetPrefixCache,
)
_OUTPUT_TYPES: tuple[type[Any], ...] = (
    StepResult,
    CoreStarted,
    IdleReply,
    CoreFailed,
    LoRAReply,
    ResetReply,
)
_Frame = tuple[int, msgspec.Raw]


class TaggedCodec:
    """Frames ``[tag, payload]`` over a fixed tuple of record types."""

    def __init__(self, types: tuple[type[Any], ...]) -> None:
        self._tags = {t: i for i, t in enumerate(types)}
        self._decoders = [msgspec.msgpack.Decoder(t) for t in types]
        self._frame = msgspec.msgpack.Decoder(_Frame)
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message: Any) -> bytes:
        return self._encoder.encode((self._tags[type(message)], message))

    def decode(self, data: bytes | memoryview) -> Any:
        tag, payload = self._frame.decode(data)
        if not 0 <= tag < len(self._decoders):
            raise msgspec.ValidationError(f"unknown message tag {tag}")
        return self._decoders[tag].decode(payload)


class InputCodec(TaggedCodec):
    def __init__(self) -> None:
        super().__init__(_INPUT_TYPES)

    def decode_input(self, data: bytes | memoryview) -> CoreInput:
        message: CoreInput = self.decode(data)
        return message


class OutputCodec(TaggedCodec):
    def __init__(self) -> None:
        super().__init__(_OUTPUT_TYPES)

    def decode_output(self, data: bytes | memoryview) -> CoreOutput:
        message: CoreOutput = self.decode(data)
        return message
