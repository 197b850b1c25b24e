"""The HF-parity anchor: prompts and HF transformers' own greedy generate() to compare the
engine with."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

NEW_TOKENS = 32


SHARED_PREFIX = [(11 * j) % 500 + 3 for j in range(40)]


def distinct_prompts() -> list[list[int]]:
    """8 prompts of different lengths (5..68 tokens)."""
    return [[(37 * i + 13 * j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(8)]


def shared_prefix_prompts() -> list[list[int]]:
    return [SHARED_PREFIX + [(17 * i + j) % 500 + 3 for j in range(3 + 2 * i)] for i in range(8)]


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
            out.append(ids[0, len(p) :].tolist())
    return out
