"""The ``vlm`` stage of ``gpu_check.py`` (issue 33): a 3B-class vision-language model with
dummy weights, image+text requests.

The bundled ``qwen2.5-vl-3b`` config (Qwen2.5-VL-3B-Instruct's published config.json: a
32-block, width-1280 vision transformer with 14-pixel patches merged 2 x 2 and a 36-layer
Qwen2 text model of width 2048) goes into a folder beside transformers' Qwen2-VL image
processor (the checkpoint's preprocessor settings, every image resized to ``--image-side``
pixels square), and the offline engine loads it with ``--load-format dummy`` in bfloat16.
Two measurements, each recorded as it finishes:

- ``vlm_throughput``: a batch of requests, each a new random image between two text runs
  (``[text, <|vision_start|>, <|image_pad|>, <|vision_end|>, text]``), ignore-EOS output:
  requests/s, output tok/s and the encoder's share of the run (the step records);
- ``vlm_ttft``: per round one request with a new image and one with a repeated one (whose
  features the encoder-output cache holds), alternating which goes first, each after text no
  earlier request had (so the prefix cache misses at the image): median TTFT of each.

``--smoke``: a tiny stand-in with the same structure (a 2-block vision transformer, 4-pixel
patches), on the CPU in float32, with tiny counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np

SMOKE_VLM_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "image_token_id": 100, "vision_start_token_id": 101, "vision_end_token_id": 102,
    "video_token_id": 103, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "vision_config": {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3,
        "window_size": 16, "fullatt_block_indexes": [1], "out_hidden_size": 64,
    },
}  # fmt: skip
TEXT_TOKENS = 32  # text tokens on each side of the image


class Record(Protocol):
    def __call__(self, **record: Any) -> None: ...


def model_folder(args: argparse.Namespace, out: Path) -> Path:
    """``out`` with the config.json (bundled, or the smoke stand-in) and an image processor
    whose every image becomes ``--image-side`` pixels square."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from tokenwire.runtime.loader.bundled_configs import bundled_config_path

    if args.smoke:
        config = SMOKE_VLM_CONFIG
    else:
        path = bundled_config_path(args.model)
        if path is None:
            raise SystemExit(f"vlm: {args.model!r} is not a bundled config")
        config = json.loads(path.read_text())
    vision = config["vision_config"]
    pixels = args.image_side * args.image_side
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    Qwen2VLImageProcessorPil(
        min_pixels=pixels, max_pixels=pixels, patch_size=vision["patch_size"],
        merge_size=vision["spatial_merge_size"],
        temporal_patch_size=vision["temporal_patch_size"],
    ).save_pretrained(out)  # fmt: skip
    return out


def _image(seed: int, side: int) -> Any:
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _prompt(config: dict[str, Any], first: int, seed: int, side: int) -> dict[str, Any]:
    """Text (starting with ``first``, so each prompt's text is new), the image, more text."""
    vocab = int(config["vocab_size"])
    text = [3 + (first * 7919 + i * 31) % (min(vocab, 32000) - 3) for i in range(TEXT_TOKENS)]
    special = [config["vision_start_token_id"], config["image_token_id"],
               config["vision_end_token_id"]]  # fmt: skip
    return {
        "prompt_token_ids": [first % (vocab - 3) + 3, *text, *special, *text[::-1]],
        "multi_modal_data": {"image": [_image(seed, side)]},
    }


def _ttft(llm: Any, prompt: dict[str, Any]) -> float:
    from tokenwire.runtime.sampling_params import SamplingParams

    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def stage_vlm(args: argparse.Namespace, record: Record, work: Path) -> None:
    from tokenwire.bench.throughput import build_llm
    from tokenwire.runtime.engine_args import EngineArgs
    from tokenwire.runtime.sampling_params import SamplingParams
    from tokenwire.runtime.stats import StepRecorder

    folder = model_folder(args, work / "vlm-model")
    config = json.loads((folder / "config.json").read_text())
    label, side = args.label or args.model, args.image_side
    engine = EngineArgs(
        model=str(folder), load_format="dummy", device="cpu" if args.smoke else "cuda",
        dtype="float32" if args.smoke else "bfloat16", max_model_len=4096,
        max_num_batched_tokens=8192,
    )  # fmt: skip
    steps = StepRecorder()
    start = time.perf_counter()
    llm = build_llm(engine, steps)
    record(kind="startup", model=label, seconds=round(time.perf_counter() - start, 2))
    _ttft(llm, _prompt(config, 1, 1, side))  # warm-up (and compile)
    requests, output = (2, 4) if args.smoke else (args.vlm_requests, 64)
    prompts = [_prompt(config, 10 + i, 10 + i, side) for i in range(requests)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output)
    steps.steps.clear()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    encoder = sum(s.encoder_time for s in steps.steps)
    vision = config["vision_config"]
    placeholders = (side // (vision["patch_size"] * vision["spatial_merge_size"])) ** 2
    record(kind="vlm_throughput", model=label, requests=requests, image_side=side,
           output_tokens=requests * output, seconds=round(seconds, 3),
           requests_s=round(requests / seconds, 2),
           output_tok_s=round(requests * output / seconds, 1),
           images_encoded=sum(s.num_images_encoded for s in steps.steps),
           encoder_share=round(encoder / seconds, 3), image_tokens=placeholders)  # fmt: skip
    _record_ttft(llm, config, args, record, steps)
    llm.shutdown()


def _record_ttft(
    llm: Any, config: dict[str, Any], args: argparse.Namespace, record: Record, steps: Any
) -> None:
    """Median TTFT of a new image vs a repeated one (image seed 1), interleaved. Image 1 is
    encoded again first: the throughput batch may have evicted it from the cache."""
    times: dict[str, list[float]] = {"new": [], "repeat": []}
    rounds = 2 if args.smoke else args.vlm_rounds
    _ttft(llm, _prompt(config, 8000, 1, args.image_side))
    steps.steps.clear()
    for r in range(rounds):
        order = ["new", "repeat"] if r % 2 == 0 else ["repeat", "new"]
        for kind in order:
            seed = 5000 + r if kind == "new" else 1
            first = 9000 + 2 * r + (kind == "new")
            times[kind].append(_ttft(llm, _prompt(config, first, seed, args.image_side)))
    new, repeat = statistics.median(times["new"]), statistics.median(times["repeat"])
    record(kind="vlm_ttft", model=args.label or args.model, rounds=rounds,
           new_ms=round(new * 1e3, 2), repeat_ms=round(repeat * 1e3, 2),
           ratio=round(repeat / new, 3),
           encoder_cache_hits=sum(s.num_encoder_cache_hits for s in steps.steps))  # fmt: skip
