"""TTFT of a prompt whose image the encoder-output cache holds vs one with a new image.

Builds a random LLaVA in a temporary directory (a CLIP ViT-B/16 vision tower at 224 pixels:
196 image features; a small Llama text model), then, in one offline engine on the CPU, per
round: a prompt with a new image and a prompt with the first round's image, each after text
no earlier prompt has (so the prefix cache misses and the repeat reaches the encoder cache),
alternating which goes first. TTFT is one greedy token's wall time; the encoder seconds come
from the step records.

    .venv/bin/python scripts/encoder_cache_ttft.py --rounds 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
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

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder

IMAGE_TOKEN = 500


def _save_model(path: Path) -> None:
    text = LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, image_size=224, patch_size=16,
    )  # fmt: skip
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    model.train(False)
    model.save_pretrained(path)
    CLIPImageProcessor(
        size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}
    ).save_pretrained(path)


def _image(seed: int) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (240, 320, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _ttft(llm: LLM, first: int, seed: int) -> float:
    prompt = {
        "prompt_token_ids": [1, first, 10, 11, IMAGE_TOKEN, *range(20, 52)],
        "multi_modal_data": {"image": [_image(seed)]},
    }
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description="TTFT: repeated vs new image (encoder cache)")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _save_model(Path(tmp))
        recorder = StepRecorder()
        llm = LLM(tmp, device="cpu", observer=recorder)
        _ttft(llm, 100, seed=0)  # warm-up; the image every "repeat" prompt uses
        new: list[float] = []
        repeat: list[float] = []
        for r in range(args.rounds):
            order = [("new", 1000 + r), ("repeat", 0)]
            for kind, seed in order if r % 2 == 0 else order[::-1]:
                (new if kind == "new" else repeat).append(_ttft(llm, 200 + 2 * r + len(new), seed))
        encoded = [s.encoder_time for s in recorder.steps if s.num_images_encoded]
        hits = sum(s.num_encoder_cache_hits for s in recorder.steps)
        llm.shutdown()
    new_ms, repeat_ms = statistics.median(new) * 1e3, statistics.median(repeat) * 1e3
    print(f"rounds {args.rounds}: median TTFT new image {new_ms:.1f} ms, repeated image "
          f"{repeat_ms:.1f} ms (ratio {repeat_ms / new_ms:.2f}); encoder per image median "
          f"{statistics.median(encoded) * 1e3:.1f} ms over {len(encoded)} encodes, "
          f"{hits} cache hits; load average {os.getloadavg()[0]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
