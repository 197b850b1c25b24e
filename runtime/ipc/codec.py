"""msgspec (MessagePack) encoding of the front <-> core records; never pickle on a socket.

A frame is ``[tag, payload]``: the tag names the record type, and the payload is decoded
straight into that type (msgspec validates every field's type while decoding), so bytes from
the socket can only ever become one of the declared plain records. A numpy array (an image's
processed pixels, ``multimodal.ImageInput``) travels as ``[dtype, shape, bytes]`` of a plain
numeric dtype (``_encode_array`` / ``_decode_array``).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

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
_ARRAY_KINDS = frozenset("biuf")  # bool, signed, unsigned, float: never objects


def _encode_array(obj: Any) -> Any:
    if isinstance(obj, np.ndarray) and obj.dtype.kind in _ARRAY_KINDS:
        return (obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes())
    raise TypeError(f"cannot encode {type(obj).__name__} (numeric numpy arrays only)")


def _decode_array(kind: type[Any], obj: Any) -> Any:
    if kind is not np.ndarray:
        raise NotImplementedError(f"cannot decode {kind}")
    dtype_text, shape, data = obj
    dtype = np.dtype(dtype_text)
    if dtype.kind not in _ARRAY_KINDS or not isinstance(data, bytes):
        raise msgspec.ValidationError(f"not a numeric array: {dtype_text}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count * dtype.itemsize != len(data):
        raise msgspec.ValidationError(f"array bytes do not match shape {shape}")
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


class TaggedCodec:
    """Frames ``[tag, payload]`` over a fixed tuple of record types."""

    def __init__(self, types: tuple[type[Any], ...]) -> None:
        self._tags = {t: i for i, t in enumerate(types)}
        self._decoders = [msgspec.msgpack.Decoder(t, dec_hook=_decode_array) for t in types]
        self._frame = msgspec.msgpack.Decoder(_Frame)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encode_array)

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
