"""A tiny random LLaVA checkpoint (Llama text model + CLIP vision tower) saved with
``save_pretrained`` beside its image processor, and synthetic images: what the LLaVA tests
load by path (``tests/runtime/test_llava.py``, ``test_encoder_cache.py``,
``tests/server/test_vision_serve.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

IMAGE_TOKEN = 100
PATCHES = 16  # (32 // 8) ** 2, the CLS feature dropped ("default" strategy)


def synthetic_image(seed: int, size: tuple[int, int] = (40, 48)) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def save_tiny_llava(
    path: Path, vocab_size: int = 128, image_token: int = IMAGE_TOKEN, max_position: int = 256
) -> Path:
    """The checkpoint and its image processor in ``path`` (no tokenizer: callers add theirs)."""
    text = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_token)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights than the 0.02 init: images move the argmax
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    processor = CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    processor.save_pretrained(path)
    return path
