"""A tiny random Gemma 3 multimodal checkpoint (Gemma 3 text model + SigLIP vision tower,
``Gemma3ForConditionalGeneration``) saved with ``save_pretrained`` beside its image processor
(transformers' PIL ``Gemma3ImageProcessorPil``): what the Gemma 3 vision tests load by path
(``tests/runtime/test_gemma3_mm.py``,
``tests/server/test_gemma3_vision_serve.py``). One sliding-window layer (window 8, shorter than an
image's run plus its text) and one full layer, so both of HF's image masks are exercised."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    SiglipVisionConfig,
)
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

IMAGE_TOKEN = 100
BOI_TOKEN = 101
EOI_TOKEN = 102
IMAGE_TOKENS = 16  # mm_tokens_per_image: (32 // 4) ** 2 patches average-pooled to 4 x 4
WINDOW = 8


def save_tiny_gemma3_mm(
    path: Path,
    vocab_size: int = 128,
    max_position: int = 256,
    tokens: tuple[int, int, int] = (IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN),
) -> Path:
    """The checkpoint and its image processor in ``path`` (no tokenizer: callers add theirs);
    ``tokens``: the image, begin-of-image and end-of-image token ids."""
    text = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=max_position,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    vision = SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=4,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=IMAGE_TOKENS,
        image_token_index=tokens[0],
        boi_token_index=tokens[1],
        eoi_token_index=tokens[2],
        tie_word_embeddings=False,  # tied, the last token's own embedding wins every step
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights than the 0.02 init: images move the argmax
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    return path
