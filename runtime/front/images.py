"""``ImagePrompter``: a prompt's images through the model's image processor, and its image
placeholders expanded the way the model's HF processor expands them.

The image processor is transformers' own (``AutoImageProcessor`` of the model directory's
``preprocessor_config.json``: resizing, cropping and normalization are never reimplemented
here). Each image marker token in the prompt stands for one image, in order, and becomes
the run of placeholder tokens the image's features fill (``ImageTokens``): LLaVA's
``<image>`` becomes ``num_image_tokens`` image tokens (one per patch feature, as
``LlavaProcessor`` expands it); Gemma 3's ``<start_of_image>`` becomes itself,
``mm_tokens_per_image`` image tokens and ``<end_of_image>`` (``Gemma3Processor``'s
``full_image_sequence``; the two blank lines it adds on each side are text, which a chat
render adds, ``chat_text_around``, and token ids a caller gives hold or not). The result is
the expanded token ids and one ``ImageInput`` per image (position, run length, pixels,
content hash, whether its rows attend bidirectionally).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.models.gemma3_mm_config import gemma3_mm_spec, is_gemma3_mm
from tokenwire.runtime.models.llava_config import is_llava, llava_spec
from tokenwire.runtime.multimodal import ImageInput, pixel_hash

_PARAM = "multi_modal_data"


@dataclass(frozen=True)
class ImageTokens:
    """How a model's prompt names an image: ``marker`` becomes ``prefix``, ``run`` copies of
    ``token`` (the placeholder rows the features fill) and ``suffix``."""

    marker: int
    token: int
    run: int
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    bidirectional: bool = False  # the run's rows see the whole run during prefill (Gemma 3)
    # Text a chat render puts on each side of the marker (Gemma 3's processor: "\n\n").
    chat_text_around: str = ""

    @classmethod
    def of_config(cls, config: dict[str, Any]) -> ImageTokens | None:
        """The image tokens of a config.json; None for a model that takes no images."""
        if is_llava(config):
            llava = llava_spec(config)
            return cls(llava.image_token_index, llava.image_token_index, llava.num_image_tokens)
        if is_gemma3_mm(config):
            gemma = gemma3_mm_spec(config)
            return cls(
                gemma.boi_token_index, gemma.image_token_index, gemma.num_image_tokens,
                (gemma.boi_token_index,), (gemma.eoi_token_index,), bidirectional=True,
                chat_text_around="\n\n",
            )  # fmt: skip
        return None


@dataclass(frozen=True)
class ImagePrompter:
    spec: ImageTokens
    processor: Any  # transformers' image processor of the model

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ImagePrompter | None:
        """The model's prompter; None for a model that takes no images."""
        config_file = Path(model_dir) / "config.json"
        if not config_file.is_file():
            return None
        tokens = ImageTokens.of_config(json.loads(config_file.read_text()))
        if tokens is None:
            return None
        from transformers import AutoImageProcessor

        return cls(tokens, AutoImageProcessor.from_pretrained(str(model_dir)))

    def expand(
        self, token_ids: Sequence[int], images: Sequence[Any]
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """(token ids with each image placeholder expanded, the images' inputs)."""
        spec = self.spec
        token = spec.marker
        count = sum(1 for t in token_ids if t == token)
        if count != len(images):
            raise ParameterError(
                _PARAM,
                f"the prompt has {count} image placeholders (token {token}) "
                f"for {len(images)} images",
            )
        if not images:
            return list(token_ids), ()
        pixels = self.pixel_values(images)
        expanded: list[int] = []
        inputs: list[ImageInput] = []
        for t in token_ids:
            if t != token:
                expanded.append(t)
                continue
            image_pixels = pixels[len(inputs)]
            expanded.extend(spec.prefix)
            inputs.append(
                ImageInput(
                    len(expanded), spec.run, pixel_hash(image_pixels), image_pixels,
                    spec.bidirectional,
                )
            )  # fmt: skip
            expanded.extend([spec.token] * spec.run)
            expanded.extend(spec.suffix)
        return expanded, tuple(inputs)

    def pixel_values(self, images: Sequence[Any]) -> np.ndarray:
        """[images, channels, height, width] float32, as the image processor makes them."""
        try:
            out = self.processor(images=list(images), return_tensors="np")
        except (TypeError, ValueError) as exc:
            raise ParameterError(_PARAM, f"the image processor refused an image: {exc}") from exc
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        if pixels.shape[0] != len(images):  # e.g. Gemma 3's pan-and-scan crops
            raise ParameterError(
                _PARAM,
                f"the image processor made {pixels.shape[0]} pixel arrays for {len(images)} "
                "images (crops such as pan-and-scan are not supported)",
            )
        return pixels
