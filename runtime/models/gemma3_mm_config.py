"""The multimodal facts of a Gemma 3 multimodal config.json (``Gemma3ForConditionalGeneration``),
read through transformers' ``Gemma3Config`` (its defaults and sub-configs), torch-free: the
front expands each image's begin-of-image token with them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GEMMA3_MM = "Gemma3ForConditionalGeneration"


@dataclass(frozen=True)
class Gemma3MMSpec:
    """Gemma 3's image tokens: the prompt names an image with ``boi_token_index``; HF's
    ``Gemma3Processor`` makes that ``boi``, ``mm_tokens_per_image`` image tokens, ``eoi``."""

    image_token_index: int
    boi_token_index: int
    eoi_token_index: int
    mm_tokens_per_image: int

    @property
    def num_image_tokens(self) -> int:
        return self.mm_tokens_per_image


def is_gemma3_mm(config: Mapping[str, Any]) -> bool:
    return GEMMA3_MM in (config.get("architectures") or []) or config.get("model_type") == "gemma3"


def hf_gemma3_config(config: Mapping[str, Any]) -> Any:
    """transformers' ``Gemma3Config`` of a config.json (its defaults, its sub-configs)."""
    from transformers import Gemma3Config

    return Gemma3Config.from_dict(dict(config))


def gemma3_mm_spec(config: Mapping[str, Any]) -> Gemma3MMSpec:
    hf = hf_gemma3_config(config)
    return Gemma3MMSpec(
        image_token_index=int(hf.image_token_id),
        boi_token_index=int(hf.boi_token_id),
        eoi_token_index=int(hf.eoi_token_id),
        mm_tokens_per_image=int(hf.mm_tokens_per_image),
    )


def gemma3_text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config (a ``Gemma3ForCausalLM`` config.json dict)."""
    text: dict[str, Any] = hf_gemma3_config(config).text_config.to_dict()
    text["architectures"] = ["Gemma3ForCausalLM"]
    return text
