"""``ImagePrompter``: a prompt's images through the model's image processor, and its image
placeholders expanded the way the model's HF processor expands them.

The image processor is transformers' own (``AutoImageProcessor`` of the model directory's
``preprocessor_config.json``: resizing, cropping and normalization are never reimplemented
here). Each image placeholder token in the prompt (``image_token_index``) stands for one
image, in order, and becomes ``num_image_tokens`` placeholder tokens (one per patch feature,
as ``LlavaProcessor`` expands ``<image>``); the result is the expanded token ids and one
``ImageInput`` per image (position, run length, pixels, content hash).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.models.llava_config import LlavaSpec, is_llava, llava_spec
from tokenwire.runtime.multimodal import ImageInput, pixel_hash

_PARAM = "multi_modal_data"


@dataclass(frozen=True)
class ImagePrompter:
    spec: LlavaSpec
    processor: Any  # transformers' image processor of the model

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ImagePrompter | None:
        """The model's prompter; None for a model that takes no images."""
        config_file = Path(model_dir) / "config.json"
        if not config_file.is_file():
            return None
        config = json.loads(config_file.read_text())
        if not is_llava(config):
            return None
        from transformers import AutoImageProcessor

        return cls(llava_spec(config), AutoImageProcessor.from_pretrained(str(model_dir)))

    def expand(
        self, token_ids: Sequence[int], images: Sequence[Any]
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """(token ids with each image placeholder expanded, the images' inputs)."""
        token = self.spec.image_token_index
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
        run = self.spec.num_image_tokens
        expanded: list[int] = []
        inputs: list[ImageInput] = []
        for t in token_ids:
            if t != token:
                expanded.append(t)
                continue
            image_pixels = pixels[len(inputs)]
            inputs.append(ImageInput(len(expanded), run, pixel_hash(image_pixels), image_pixels))
            expanded.extend([token] * run)
        return expanded, tuple(inputs)

    def pixel_values(self, images: Sequence[Any]) -> np.ndarray:
        """[images, channels, height, width] float32, as the image processor makes them."""
        try:
            out = self.processor(images=list(images), return_tensors="np")
        except (TypeError, ValueError) as exc:
            raise ParameterError(_PARAM, f"the image processor refused an image: {exc}") from exc
        return np.asarray(out["pixel_values"], dtype=np.float32)
