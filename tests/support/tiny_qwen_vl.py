"""A tiny random Qwen2.5-VL (or Qwen2-VL) checkpoint (Qwen2 text model with M-RoPE +
dynamic-resolution vision transformer) saved with ``save_pretrained`` beside transformers'
PIL ``Qwen2VLImageProcessorPil``: what the Qwen-VL tests load by path
(``tests/runtime/test_qwen_vl.py``). Patches of 4 pixels merged 2 x 2: an image of
``h x w`` pixels (multiples of 8) becomes ``(h // 8) * (w // 8)`` placeholder tokens. The
Qwen2.5-VL tower has one windowed block (windows of 2 x 2 merged patches) and one full one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

IMAGE_TOKEN = 100
VISION_START = 101
VISION_END = 102
VIDEO_TOKEN = 103
MERGED_PIXELS = 8  # patch 4 x merge 2: one placeholder per 8 x 8 pixels


def save_tiny_qwen_vl(
    path: Path,
    qwen2_5: bool = True,
    vocab_size: int = 128,
    tokens: tuple[int, int, int, int] = (IMAGE_TOKEN, VISION_START, VISION_END, VIDEO_TOKEN),
    tied: bool = False,
) -> Path:
    """The checkpoint and its image processor in ``path`` (no tokenizer: callers add theirs);
    ``tokens``: the image, vision start, vision end and video token ids; ``tied``: the output
    projection is the embedding (as Qwen2.5-VL-3B: the checkpoint has no ``lm_head``)."""
    text: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                            "rope_theta": 10000.0},
    }  # fmt: skip
    vision: dict[str, Any] = {
        "depth": 2, "embed_dim": 16, "hidden_size": 16, "intermediate_size": 32,
        "num_heads": 2, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "in_channels": 3,
    }  # fmt: skip
    ids = dict(
        zip(["image_token_id", "vision_start_token_id", "vision_end_token_id", "video_token_id"],
            tokens, strict=True)
    )  # fmt: skip
    if qwen2_5:
        vision |= {"window_size": 16, "fullatt_block_indexes": [1], "out_hidden_size": 64}
        config: Any = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
        cls: Any = Qwen2_5_VLForConditionalGeneration
    else:
        vision |= {"mlp_ratio": 2, "hidden_size": 64}  # Qwen2-VL: the merger's output
        config = Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
        cls = Qwen2VLForConditionalGeneration
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # larger weights than the 0.02 init: images move the argmax
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(
        min_pixels=64, max_pixels=64 * 64, patch_size=4, merge_size=2, temporal_patch_size=2
    ).save_pretrained(path)
    return path
