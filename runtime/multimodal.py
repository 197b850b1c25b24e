"""``ImageInput``: one image of a request, as it crosses from the front to the executor.

The front runs the model's image processor (transformers') and expands the image's one
placeholder token into the run of placeholder tokens the model's features fill; what travels
with the request is this plain record: where the run sits in the prompt, how long it is, the
processed pixels (numpy, so the torch-free core can carry them) and a content hash of those
pixels. The scheduler hashes the image into the prefix-cache keys of every block the run
overlaps (``image_extra_keys``), so two prompts that differ only in an image never share KV.
An image whose rows attend bidirectionally (Gemma 3) is computed whole in one step.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenwire.runtime.errors import ParameterError


@dataclass(frozen=True, slots=True, eq=False)
class ImageInput:
    """One image's placeholder run ``[offset, offset + length)`` in the prompt, and pixels."""

    offset: int  # prompt position of the run's first placeholder token
    length: int  # placeholder tokens: the image's feature vectors
    content_hash: str  # sha256 hex of the processed pixels (``pixel_hash``)
    pixel_values: np.ndarray  # [channels, height, width] as the image processor made them
    # The run's rows attend to the whole run during prefill (Gemma 3's bidirectional image
    # attention): a step never computes part of the run (``core.encoder_cache``), and the
    # executor hands the run to the attention (``AttentionMetadata.image_spans``).
    bidirectional: bool = False
    # Dynamic-resolution models (Qwen-VL): the image's patch grid (temporal, height, width)
    # as the image processor made it (``image_grid_thw``); ``pixel_values`` are then its
    # flattened patches [patches, features]. None: a fixed-size image.
    grid_thw: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


def pixel_hash(pixel_values: np.ndarray, extra: str = "") -> str:
    """Content hash of processed pixels: dtype, shape, bytes (and ``extra``: a patch grid)."""
    head = f"{pixel_values.dtype}:{pixel_values.shape}" + (f":{extra}" if extra else "")
    digest = hashlib.sha256(head.encode())
    digest.update(np.ascontiguousarray(pixel_values).tobytes())
    return digest.hexdigest()


def salted_images(images: tuple[ImageInput, ...], cache_salt: str | None) -> tuple[ImageInput, ...]:
    """``images`` with each content hash bound to ``cache_salt`` (unchanged without one): the
    encoder-output cache and the prefix cache key an image by its hash, so a salted request
    (an isolated tenant's) neither hits nor warms another salt's entries for the same pixels,
    which its time to first token would otherwise reveal."""
    if cache_salt is None or not images:
        return images
    salt = b"salt:" + cache_salt.encode("utf-8") + b"|"
    return tuple(
        dataclasses.replace(
            image, content_hash=hashlib.sha256(salt + image.content_hash.encode()).hexdigest()
        )
        for image in images
    )


def image_extra_keys(images: Sequence[ImageInput], start: int, end: int) -> bytes:
    """Prefix-cache extra keys of the block of prompt positions ``[start, end)``: the hash of
    every image whose placeholder run overlaps it (b"" when none does)."""
    return b"".join(
        b"image:" + image.content_hash.encode()
        for image in images
        if image.offset < end and start < image.end
    )


def image_extra_pieces(
    images: Sequence[ImageInput], start: int, end: int
) -> tuple[tuple[str, int], ...]:
    """``image_extra_keys`` as KV events publish them (vLLM's multimodal extra key): one
    ``(identifier, offset)`` per overlapping image, its content hash and where its first
    placeholder lies relative to the block's first token (negative: in an earlier block), as
    vLLM's ``(mm identifier, offset - start_token_idx)``; the hash took
    ``b"image:" + identifier`` for each."""
    return tuple(
        (image.content_hash, image.offset - start)
        for image in images
        if image.offset < end and start < image.end
    )


def check_images(
    images: Sequence[ImageInput], num_prompt_tokens: int, max_image_tokens: int | None = None
) -> None:
    """Placeholder runs lie inside the prompt, in order, without overlapping; each at most
    ``max_image_tokens`` long (the encoder-output cache's size, ``--encoder-cache-size``)."""
    previous_end = 0
    for image in images:
        if max_image_tokens is not None and image.length > max_image_tokens:
            raise ParameterError(
                "multi_modal_data",
                f"an image of {image.length} feature tokens exceeds the encoder cache's "
                f"{max_image_tokens} (--encoder-cache-size)",
            )
        if image.length <= 0 or image.offset < previous_end or image.end > num_prompt_tokens:
            raise ParameterError(
                "multi_modal_data",
                f"image placeholder run [{image.offset}, {image.end}) is empty, overlaps "
                f"another or leaves the prompt of {num_prompt_tokens} tokens",
            )
        previous_end = image.end
