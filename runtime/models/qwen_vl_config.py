"""The multimodal facts of a Qwen2-VL / Qwen2.5-VL config.json, read through transformers'
``Qwen2VLConfig`` / ``Qwen2_5_VLConfig`` (their defaults and sub-configs), torch-free: the
front expands each ``<|image_pad|>`` into the image's run of placeholder tokens, whose length
depends on the image's size (dynamic resolution: one token per ``spatial_merge_size`` squared
patches), and the executor lays out the language model's 3D rotary positions (M-RoPE)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
_MODEL_TYPES = {"qwen2_vl": QWEN2_VL, "qwen2_5_vl": QWEN2_5_VL}


@dataclass(frozen=True)
class QwenVLSpec:
    """What the front and the executor read of a Qwen-VL config."""

    architecture: str  # QWEN2_VL or QWEN2_5_VL
    image_token_index: int  # <|image_pad|>: the placeholder the features fill
    vision_start_token_index: int  # <|vision_start|>, text before each image's run
    vision_end_token_index: int  # <|vision_end|>, text after it
    spatial_merge_size: int  # patches merged per feature along each side
    mrope_section: tuple[int, int, int]  # rotary frequencies per (temporal, height, width)

    @property
    def num_image_tokens(self) -> int:
        """No fixed count: each image's run follows its size (``image_run_length``)."""
        return 0

    def image_run_length(self, grid_thw: tuple[int, int, int]) -> int:
        """Placeholder tokens of an image of ``grid_thw`` patches (as ``Qwen2VLProcessor``)."""
        t, h, w = grid_thw
        return t * h * w // (self.spatial_merge_size**2)


def qwen_vl_architecture(config: Mapping[str, Any]) -> str | None:
    """QWEN2_VL or QWEN2_5_VL for such a config.json, else None."""
    for name in config.get("architectures") or []:
        if name in (QWEN2_VL, QWEN2_5_VL):
            return str(name)
    return _MODEL_TYPES.get(str(config.get("model_type")))


def is_qwen_vl(config: Mapping[str, Any]) -> bool:
    return qwen_vl_architecture(config) is not None


def hf_qwen_vl_config(config: Mapping[str, Any]) -> Any:
    """transformers' config object of a Qwen-VL config.json."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    cls = Qwen2_5_VLConfig if qwen_vl_architecture(config) == QWEN2_5_VL else Qwen2VLConfig
    return cls.from_dict(dict(config))


def qwen_vl_spec(config: Mapping[str, Any]) -> QwenVLSpec:
    hf = hf_qwen_vl_config(config)
    section = hf.text_config.rope_parameters.get("mrope_section")
    if section is None or len(section) != 3:
        raise ValueError(f"a Qwen-VL config needs a 3-part mrope_section, got {section!r}")
    text = hf.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if 2 * sum(section) != head_dim:  # one rotary frequency per pair of head features
        raise ValueError(
            f"mrope_section {list(section)} must sum to head_dim / 2 = {head_dim // 2}, "
            f"got {sum(section)}"
        )
    return QwenVLSpec(
        architecture=str(qwen_vl_architecture(config)),
        image_token_index=int(hf.image_token_id),
        vision_start_token_index=int(hf.vision_start_token_id),
        vision_end_token_index=int(hf.vision_end_token_id),
        spatial_merge_size=int(hf.vision_config.spatial_merge_size),
        mrope_section=(int(section[0]), int(section[1]), int(section[2])),
    )


def qwen_vl_text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config: a ``Qwen2ForCausalLM`` config.json dict."""
    hf = hf_qwen_vl_config(config)
    text: dict[str, Any] = hf.text_config.to_dict()
    # Tying is the top-level config's (Qwen2.5-VL-3B ties, 7B does not; the text config
    # has no such field): a tied checkpoint has no lm_head weight.
    text["tie_word_embeddings"] = bool(hf.tie_word_embeddings)
    text["architectures"] = ["Qwen2ForCausalLM"]
    text["model_type"] = "qwen2"
    return text
