#!/usr/bin/env python3
"""Served TTFT of a chat request whose image the encoder-output cache holds vs one with a new
image (issue 33's figure), interleaved in one run against one ``tokenwire serve``.

Builds a random Qwen2.5-VL in a temporary directory (the default model's tokenizer and chat
template; a 8-block vision transformer of width 384 with 14-pixel patches merged 2 x 2, so a
448 x 448 image is 1024 patches and 256 placeholder tokens; a 4-layer text model of width
256), serves it on the CPU, warms it up with image 0, then per round streams one chat
completion (``max_tokens`` 1) with a new image and one with image 0, alternating which goes
first. Each request's text before the image is new (a round counter), so the prefix cache
misses at the image and only the encoder-output cache helps the repeat. TTFT is the time to
the first streamed chunk with content. Prints both medians, the ratio, the load average and
one JSON line.

    .venv/bin/python scripts/encoder_cache_ttft_served.py --rounds 6
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tokenwire.runtime.loader.default_model import default_gguf_path

EXE = shutil.which("tokenwire", path=os.path.dirname(sys.executable)) or "tokenwire"
IMAGE, START, END, VIDEO = 4, 5, 6, 7  # SmolLM2 special tokens no user text produces
SIDE = 448  # pixels: 32 x 32 patches of 14, 16 x 16 = 256 placeholder tokens


def save_model(path: Path) -> None:
    """The random Qwen2.5-VL, its image processor and the default model's tokenizer."""
    gguf = default_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text: dict[str, Any] = {
        "vocab_size": len(tokenizer), "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
        "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12],
                            "rope_theta": 10000.0},
    }  # fmt: skip
    vision: dict[str, Any] = {
        "depth": 8, "hidden_size": 384, "intermediate_size": 1024, "num_heads": 6,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
        "window_size": 112, "fullatt_block_indexes": [3, 7], "out_hidden_size": 256,
    }  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE,
        vision_start_token_id=START, vision_end_token_id=END, video_token_id=VIDEO,
    )  # fmt: skip
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.train(False)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(
        min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE, patch_size=14, merge_size=2,
        temporal_patch_size=2,
    ).save_pretrained(path)  # fmt: skip
    tokenizer.save_pretrained(path)


def data_url(seed: int) -> str:
    pixels = np.random.RandomState(seed).randint(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def start_server(model: Path, log: list[str]) -> tuple[subprocess.Popen[str], str]:
    """The server and its REST URL; ``log`` gets its output after the startup line."""
    proc = subprocess.Popen(
        [EXE, "serve", str(model), "--device", "cpu", "--port", "0", "--grpc-port", "0",
         "--max-model-len", "1024"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"serving model=.* grpc=(\S+:\d+) rest=(\S+)", line)
        if match:
            threading.Thread(target=log.extend, args=(proc.stdout,), daemon=True).start()
            return proc, match.group(2).rstrip("/")
    raise RuntimeError(f"tokenwire serve exited ({proc.wait()}) before serving")


def ttft(client: httpx.Client, url: str, text: str, image: str) -> float:
    """Seconds to the first streamed chunk with content (one greedy token)."""
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": image}},
               {"type": "text", "text": " What is it?"}]  # fmt: skip
    model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1,
            "temperature": 0.0, "stream": True}  # fmt: skip
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read().decode()[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without content")


def main() -> None:
    parser = argparse.ArgumentParser(description="served TTFT: repeated vs new image")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp))
        log: list[str] = []
        proc, url = start_server(Path(tmp), log)
        try:
            with httpx.Client(timeout=600) as client:
                repeat_image = data_url(0)
                ttft(client, url, "Warm-up: look at this: ", repeat_image)
                times: dict[str, list[float]] = {"new": [], "repeat": []}
                for r in range(args.rounds):
                    order = ["new", "repeat"] if r % 2 == 0 else ["repeat", "new"]
                    for kind in order:
                        image = data_url(1000 + r) if kind == "new" else repeat_image
                        text = f"Request {kind} {r}: look at this: "
                        times[kind].append(ttft(client, url, text, image))
        except Exception:
            print("".join(log[-40:]), file=sys.stderr)
            raise
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    new_ms = statistics.median(times["new"]) * 1e3
    repeat_ms = statistics.median(times["repeat"]) * 1e3
    load = os.getloadavg()
    print(f"rounds {args.rounds}: median TTFT new image {new_ms:.1f} ms, repeated image "
          f"{repeat_ms:.1f} ms (ratio {repeat_ms / new_ms:.2f}); load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")  # fmt: skip
    per_round = [round(b / a, 2) for a, b in zip(times["new"], times["repeat"], strict=True)]
    print(json.dumps({"new_ms": round(new_ms, 1), "repeat_ms": round(repeat_ms, 1),
                      "ratio": round(repeat_ms / new_ms, 3), "per_round_ratio": per_round,
                      "load_average": load[0]}))  # fmt: skip


if __name__ == "__main__":
    main()
