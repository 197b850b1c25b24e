#!/usr/bin/env python3
"""Render time of a session's turns with the processed-image cache off and on
(``--mm-processor-cache-bytes``; tokenwire issue #33's follow-up).

A session's turn k carries one new photo-sized image (default 1024 x 768, a JPEG) and every
later turn re-renders the whole transcript, so its 5th turn (a text turn) renders 4 earlier
images. Each round runs one 5-turn session through a fresh ``TokenizerPool`` (cache off: 0;
on: the default 256 MiB), the turns in order as a session sends them, and times each turn's
``render_chat_images`` (decode, chat template, image processor, placeholder expansion). The
image processor is transformers' own with the released model's settings, loaded from a
model directory the way the server loads it (``ImagePrompter.from_model_dir``): Qwen2.5-VL's
``Qwen2VLImageProcessor`` (patch 14, merge 2, its default pixel range) or LLaVA-1.5's
``CLIPImageProcessor`` (336 x 336); the tokenizer and chat template are the default model's
(SmolLM2), whose special tokens 4-7 stand in for the image tokens. No weights are loaded.
Prints the median milliseconds of each turn, off and on, from the same run, and one JSON line.

    .venv/bin/python scripts/processed_image_cache_cost.py --model qwen2_5_vl --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    Qwen2_5_VLConfig,
    Qwen2VLImageProcessor,
)

from tokenwire.runtime.front.frontend import Frontend
from tokenwire.runtime.front.images import ImagePrompter
from tokenwire.runtime.front.processed_images import DEFAULT_CACHE_BYTES
from tokenwire.runtime.front.tokenizer import load_tokenizer
from tokenwire.runtime.loader.default_model import default_gguf_path
from tokenwire.runtime.loader.gguf_convert import ensure_converted
from tokenwire.server.grpc.images import ImageLimits
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool

IMAGE, START, END, VIDEO = 4, 5, 6, 7  # SmolLM2 special tokens no user text produces
TURNS = 5


def save_model_dir(path: Path, model: str, vocab_size: int) -> None:
    """config.json (no weights) and the released model's image processor settings."""
    if model == "llava":
        config: Any = LlavaConfig(
            text_config=LlamaConfig(vocab_size=vocab_size),
            vision_config=CLIPVisionConfig(image_size=336, patch_size=14),
            image_token_index=IMAGE,
        )
        processor: Any = CLIPImageProcessor(
            size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}
        )
    else:
        config = Qwen2_5_VLConfig(
            text_config={
                "vocab_size": vocab_size,
                "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24]},
            },
            vision_config={"patch_size": 14, "spatial_merge_size": 2},
            image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END,
            video_token_id=VIDEO,
        )  # fmt: skip
        processor = Qwen2VLImageProcessor()  # Qwen2.5-VL's: patch 14, merge 2, its pixel range
    config.save_pretrained(path)
    processor.save_pretrained(path)


def photo(seed: int, size: tuple[int, int]) -> bytes:
    """A JPEG of smooth gradients with some noise (compresses like a photo, unlike noise)."""
    w, h = size
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([x / w * 255, y / h * 255, (x + y) / (w + h) * 255], axis=-1)
    pixels = np.clip(base * rng.uniform(0.5, 1.0, 3) + rng.normal(0, 12, (h, w, 3)), 0, 255)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def transcripts(images: list[bytes]) -> list[list[dict[str, Any]]]:
    """What each of a session's turns renders: turns 1-4 add an image, turn 5 is text."""
    out: list[list[dict[str, Any]]] = []
    messages: list[dict[str, Any]] = []
    for k in range(TURNS):
        parts: list[dict[str, Any]] = [{"type": "text", "text": f"Turn {k + 1}: what is this? "}]
        if k < len(images):
            parts.append({"type": "image", "data": images[k], "part": f"turn{k}"})
        messages = [*messages, {"role": "user", "content": parts}]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"It is picture {k + 1}."}]
    return out


async def session_ms(front: Frontend, cache_bytes: int, turns: list[Any]) -> list[float]:
    """Each turn's render milliseconds, through a fresh pool with that cache budget."""
    limits = ImageLimits(max_images=8, processor_cache_bytes=cache_bytes)
    pool = TokenizerPool(front, max_prompt_bytes=1 << 20, images=limits)
    out = []
    try:
        for messages in turns:
            t0 = time.perf_counter()
            await pool.render_chat_images("chat", messages)
            out.append(1000.0 * (time.perf_counter() - t0))
    finally:
        pool.shutdown()
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("qwen2_5_vl", "llava"), default="qwen2_5_vl")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", default="1024x768", help="each image's WIDTHxHEIGHT")
    args = ap.parse_args()
    tokenizer = load_tokenizer(ensure_converted(default_gguf_path()))
    assert tokenizer is not None
    size = tuple(int(v) for v in args.size.split("x"))
    turns = transcripts([photo(seed, (size[0], size[1])) for seed in range(TURNS - 1)])
    with tempfile.TemporaryDirectory() as tmp:
        save_model_dir(Path(tmp), args.model, len(tokenizer))
        prompter = ImagePrompter.from_model_dir(tmp)
    front = Frontend(tokenizer, vocab_size=len(tokenizer), max_model_len=1 << 20, images=prompter)
    runs: dict[str, list[list[float]]] = {"off": [], "on": []}
    await session_ms(front, 0, turns)  # warm-up (imports, first-call costs)
    for r in range(args.rounds):  # alternate which goes first
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            runs[name].append(
                await session_ms(front, 0 if name == "off" else DEFAULT_CACHE_BYTES, turns)
            )
    median = {
        name: [statistics.median(run[k] for run in rounds) for k in range(TURNS)]
        for name, rounds in runs.items()
    }
    print(f"{args.model}, {TURNS}-turn session, images {args.size} JPEG, {args.rounds} rounds")
    print("turn  images  off ms   on ms")
    for k in range(TURNS):
        images = min(k + 1, TURNS - 1)
        print(f"{k + 1:>4}  {images:>6}  {median['off'][k]:>6.1f}  {median['on'][k]:>6.1f}")
    print(json.dumps({"model": args.model, "size": args.size, "median_ms": median}))


if __name__ == "__main__":
    asyncio.run(main())
