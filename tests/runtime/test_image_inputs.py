"""Image inputs' front pieces, torch-free: ``decode_image`` (the pixel limit read from the
header before decompression, Pillow's own bomb guard, undecodable bytes: each a
``ParameterError`` naming the part) and the IPC codec carrying an ``AddRequest``'s images
(numpy pixels as dtype, shape and bytes; never an object array)."""

from __future__ import annotations

import io

import msgspec
import numpy as np
import pytest
from PIL import Image

from tokenwire.runtime.engine.messages import AddRequest, ChildRequest
from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.image_decode import decode_image
from tokenwire.runtime.ipc.codec import InputCodec
from tokenwire.runtime.multimodal import ImageInput, pixel_hash
from tokenwire.runtime.sampling_params import SamplingParams


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_decode_checks_the_declared_size_first() -> None:
    rgba = _png(Image.new("RGBA", (30, 20), (10, 20, 30, 40)))
    image = decode_image(rgba, "part", max_pixels=600)
    assert image.mode == "RGB" and image.size == (30, 20)
    with pytest.raises(ParameterError, match=r"part: the image is 30x20 = 600 pixels.*599"):
        decode_image(rgba, "part", max_pixels=599)
    bomb = _png(Image.new("1", (20_000, 10_000)))  # 200 M pixels in ~25 kB
    assert len(bomb) < 100_000
    with pytest.raises(ParameterError, match="--max-image-pixels"):
        decode_image(bomb, "part", max_pixels=10**6)
    # Above Pillow's own guard (2 x Image.MAX_IMAGE_PIXELS) with a larger limit of ours.
    with pytest.raises(ParameterError, match=r"part: .*--max-image-pixels"):
        decode_image(bomb, "part", max_pixels=10**12)


def _saved(fmt: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format=fmt)
    return out.getvalue()


TRUNCATED = _png(Image.new("RGB", (8, 8)))[:40]


@pytest.mark.parametrize(
    "data",
    [b"", b"garbage", TRUNCATED, _saved("PPM"), _saved("ICO")],
    ids=["empty", "garbage", "truncated", "ppm", "ico"],
)
def test_undecodable_bytes_name_the_part(data: bytes) -> None:
    with pytest.raises(ParameterError, match=r"parts\.3: not a decodable image"):
        decode_image(data, "parts.3", max_pixels=10**6)


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_the_common_formats_decode(fmt: str) -> None:
    assert decode_image(_saved(fmt), "part", max_pixels=64).size == (8, 8)


def _add(images: tuple[ImageInput, ...]) -> AddRequest:
    params = SamplingParams(max_tokens=1)
    return AddRequest("r", [1, 2, 3, 4], [ChildRequest("r-0", params)], images=images)


def test_the_codec_carries_an_add_requests_images() -> None:
    pixels = np.random.RandomState(0).rand(3, 4, 5).astype(np.float32)
    image = ImageInput(1, 2, pixel_hash(pixels), pixels)
    gemma = ImageInput(5, 2, pixel_hash(pixels), pixels, bidirectional=True)
    qwen = ImageInput(8, 2, pixel_hash(pixels, "(1, 2, 4)"), pixels, grid_thw=(1, 2, 4))
    codec = InputCodec()
    decoded = codec.decode_input(codec.encode(_add((image, gemma, qwen))))
    assert isinstance(decoded, AddRequest) and len(decoded.images) == 3
    assert [i.grid_thw for i in decoded.images] == [None, None, (1, 2, 4)]
    assert qwen.content_hash != image.content_hash  # the grid is part of the hash
    got = decoded.images[0]
    assert (got.offset, got.length, got.content_hash) == (1, 2, image.content_hash)
    assert [i.bidirectional for i in decoded.images] == [False, True, False]
    assert got.pixel_values.dtype == np.float32 and np.array_equal(got.pixel_values, pixels)
    assert pixel_hash(got.pixel_values) == image.content_hash


def test_the_codec_refuses_object_arrays_and_bad_shapes() -> None:
    codec = InputCodec()
    objects = np.array([object()], dtype=object)
    with pytest.raises(TypeError, match="numeric"):
        codec.encode(_add((ImageInput(0, 1, "h", objects),)))
    # Bytes that do not match the declared shape.
    raw = msgspec.msgpack.decode(codec.encode(_add(())))
    raw[1]["images"] = [
        {"offset": 0, "length": 1, "content_hash": "h", "pixel_values": ["<f4", [2], b"1234"]}
    ]
    with pytest.raises(msgspec.ValidationError, match="shape"):
        codec.decode(msgspec.msgpack.encode(raw))
    raw[1]["images"][0]["pixel_values"] = ["|O", [1], b"12345678"]
    with pytest.raises(msgspec.ValidationError, match="numeric"):
        codec.decode(msgspec.msgpack.encode(raw))
