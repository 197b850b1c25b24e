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
render adds, ``chat_text_around``, and token ids a caller gives hold or not); Qwen-VL's
``<|image_pad|>`` becomes one pad per merged patch of that image (dynamic resolution: the
run's length follows the image's size, ``Qwen2VLProcessor``; the ``<|vision_start|>`` and
``<|vision_end|>`` around it are the prompt's). The result is the expanded token ids and one
``ImageInput`` per image (position, run length, pixels, content hash, whether its rows attend
bidirectionally, the patch grid of a dynamic-resolution image).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.processed_images import ProcessedImage
from tokenwire.runtime.models.gemma3_mm_config import gemma3_mm_spec, is_gemma3_mm
from tokenwire.runtime.models.llava_config import is_llava, llava_spec
from tokenwire.runtime.models.qwen_vl_config import is_qwen_vl, qwen_vl_spec
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
    # Token ids a chat render puts before and after the marker (Qwen-VL's chat template:
    # <|vision_start|> and <|vision_end|>); prompt token ids a caller gives hold them or not.
    chat_tokens_around: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    # Dynamic resolution (Qwen-VL): the run is the image's patches over this merge size
    # squared (``run`` unused), and the processor's patches carry their grid. 0: fixed runs.
    merge_size: int = 0

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
        if is_qwen_vl(config):
            qwen = qwen_vl_spec(config)
            token = qwen.image_token_index
            around = ((qwen.vision_start_token_index,), (qwen.vision_end_token_index,))
            return cls(
                token, token, 0, chat_tokens_around=around, merge_size=qwen.spatial_merge_size
            )
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
        self.check_count(token_ids, len(images))
        return self.place(token_ids, self.process(images) if images else [])

    def check_count(self, token_ids: Sequence[int], count: int) -> None:
        """``ParameterError`` unless the prompt has ``count`` image markers."""
        token = self.spec.marker
        found = sum(1 for t in token_ids if t == token)
        if found != count:
            raise ParameterError(
                _PARAM,
                f"the prompt has {found} image placeholders (token {token}) for {count} images",
            )

    def process(self, images: Sequence[Any]) -> list[ProcessedImage]:
        """Each image through the image processor (one call for all): its own pixels (a
        copy, not a view into the batch's array), grid and content hash."""
        out: list[ProcessedImage] = []
        for pixels, grid in self.image_arrays(images):
            own = np.array(pixels, copy=True)
            content_hash = pixel_hash(own, "" if grid is None else str(grid))
            out.append(ProcessedImage(own, grid, content_hash))
        return out

    def place(
        self, token_ids: Sequence[int], images: Sequence[ProcessedImage]
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Each marker of ``token_ids`` expanded to its processed image's run, in order (the
        count already checked)."""
        spec = self.spec
        expanded: list[int] = []
        inputs: list[ImageInput] = []
        for t in token_ids:
            if t != spec.marker:
                expanded.append(t)
                continue
            image = images[len(inputs)]
            grid = image.grid
            run = spec.run if grid is None else grid[0] * grid[1] * grid[2] // spec.merge_size**2
            expanded.extend(spec.prefix)
            inputs.append(
                ImageInput(
                    len(expanded), run, image.content_hash, image.pixels, spec.bidirectional,
                    grid,
                )
            )  # fmt: skip
            expanded.extend([spec.token] * run)
            expanded.extend(spec.suffix)
        return expanded, tuple(inputs)

    def image_arrays(
        self, images: Sequence[Any]
    ) -> list[tuple[np.ndarray, tuple[int, int, int] | None]]:
        """Each image's processed pixels and patch grid: [channels, height, width] and None,
        or (dynamic resolution) its flattened patches [patches, features] and (t, h, w)."""
        if not self.spec.merge_size:
            return [(pixels, None) for pixels in self.pixel_values(images)]
        out = self._process(images)
        grids = [(int(t), int(h), int(w)) for t, h, w in np.asarray(out["image_grid_thw"])]
        patches = np.asarray(out["pixel_values"], dtype=np.float32)
        ends = np.cumsum([t * h * w for t, h, w in grids])
        if len(grids) != len(images) or int(ends[-1]) != patches.shape[0]:
            raise ParameterError(
                _PARAM,
                f"the image processor made {patches.shape[0]} patches on {len(grids)} grids "
                f"for {len(images)} images",
            )
        pieces = np.split(patches, ends[:-1])
        return [(piece, grid) for piece, grid in zip(pieces, grids, strict=True)]

    def _process(self, images: Sequence[Any]) -> Any:
        try:
            return self.processor(images=list(images), return_tensors="np")
        except (TypeError, ValueError) as exc:
            raise ParameterError(_PARAM, f"the image processor refused an image: {exc}") from exc

    def pixel_values(self, images: Sequence[Any]) -> np.ndarray:
        """[images, channels, height, width] float32, as the image processor makes them."""
        out = self._process(images)
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        if pixels.shape[0] != len(images):  # e.g. Gemma 3's pan-and-scan crops
            raise ParameterError(
                _PARAM,
                f"the image processor made {pixels.shape[0]} pixel arrays for {len(images)} "
                "images (crops such as pan-and-scan are not supported)",
            )
        return pixels
