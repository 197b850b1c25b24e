"""The multimodal facts of a LLaVA config.json, read through transformers' ``LlavaConfig``
(its defaults and sub-configs), torch-free: the front expands placeholders with them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LLAVA = "LlavaForConditionalGeneration"


@dataclass(frozen=True)
class LlavaSpec:
    """The multimodal facts of a LLaVA config.json (HF's defaults applied)."""

    image_token_index: int
    vision_feature_layer: int | tuple[int, ...]
    vision_feature_select_strategy: str  # "default": drop the CLS feature; "full": keep it
    image_size: int
    patch_size: int

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens per image: one per patch (+ CLS under ``full``), as HF's
        ``LlavaProcessor`` expands them."""
        patches = (self.image_size // self.patch_size) ** 2
        return patches + (1 if self.vision_feature_select_strategy == "full" else 0)


def is_llava(config: Mapping[str, Any]) -> bool:
    return LLAVA in (config.get("architectures") or []) or config.get("model_type") == "llava"


def hf_llava_config(config: Mapping[str, Any]) -> Any:
    """transformers' ``LlavaConfig`` of a config.json (its defaults, its sub-configs)."""
    from transformers import LlavaConfig

    return LlavaConfig.from_dict(dict(config))


def llava_spec(config: Mapping[str, Any]) -> LlavaSpec:
    hf = hf_llava_config(config)
    layer = hf.vision_feature_layer
    return LlavaSpec(
        image_token_index=int(hf.image_token_id),
        vision_feature_layer=layer if isinstance(layer, int) else tuple(layer),
        vision_feature_select_strategy=str(hf.vision_feature_select_strategy),
        image_size=int(hf.vision_config.image_size),
        patch_size=int(hf.vision_config.patch_size),
    )


def llava_text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config (a Llama-style config.json dict)."""
    text: dict[str, Any] = hf_llava_config(config).text_config.to_dict()
    return text
