"""M-RoPE (Qwen2-VL, Qwen2.5-VL): the language model's 3D rotary positions.

Each token has three positions (temporal, height, width). A text token's three are equal and
count up by one; an image's run of placeholder tokens takes ``start + (t, h, w)`` over its
merged patch grid (``start``: the position the run begins at), and the text after it resumes
at ``start + max(h, w)`` (HF's ``get_rope_index``; a still image has one temporal step, so
``t`` is 0). A prompt's positions past its end follow ``text position + delta``, ``delta``
being the prompt's largest position + 1 - its length: decode tokens (and recomputed outputs
after a preemption) need nothing but the plain text position and the request's delta.

The rotary frequencies are split into ``mrope_section`` (t, h, w) parts, each rotated by its
own position stream (HF's ``recomposition_frequencies``): ``mrope_table`` gathers the step's
rows of the 1D ``cos_sin_cache`` (layout of ``kernels.rotary``) column part by column part,
so the decoder layers rotate with that [T, head_dim] table at positions ``0..T-1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# (first placeholder position, run length, merged grid (t, h, w)) of one image
ImageRun = tuple[int, int, tuple[int, int, int]]


def prompt_positions(num_tokens: int, runs: Sequence[ImageRun]) -> tuple[np.ndarray, int]:
    """(int64 [3, num_tokens] positions of a prompt, its rope delta)."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    cursor, current = 0, 0  # next prompt index, next position
    for offset, length, (t, h, w) in runs:
        if t * h * w != length:
            raise ValueError(f"an image run of {length} tokens for a {t}x{h}x{w} grid")
        text = offset - cursor
        out[:, cursor:offset] = np.arange(current, current + text)
        current += text
        grid = np.indices((t, h, w)).reshape(3, -1)
        out[:, offset : offset + length] = grid + current
        current += max(h, w)
        cursor = offset + length
    out[:, cursor:] = np.arange(current, current + num_tokens - cursor)
    largest = int(out.max()) if num_tokens else -1
    return out, largest + 1 - num_tokens


def step_positions(
    positions: np.ndarray, starts: np.ndarray, prompts: Sequence[tuple[np.ndarray, int]]
) -> np.ndarray:
    """int64 [3, T] positions of a step: ``positions`` [T] are the rows' text positions,
    ``starts`` [B + 1] the rows' query offsets, ``prompts`` each row's (prompt positions,
    delta) (``prompt_positions``)."""
    out = np.broadcast_to(positions, (3, len(positions))).copy()
    for i, (table, delta) in enumerate(prompts):
        lo, hi = int(starts[i]), int(starts[i + 1])
        text = positions[lo:hi]
        inside = text < table.shape[1]
        out[:, lo:hi] += delta
        if inside.any():
            out[:, lo:hi][:, inside] = table[:, text[inside]]
    return out


def mrope_table(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, section: tuple[int, int, int]
) -> torch.Tensor:
    """[T, head_dim] rotary rows for 3D ``positions`` [3, T]: frequency part ``i`` (of
    ``section``, over each half: cos then sin) read at position stream ``i``."""
    half = cos_sin_cache.shape[1] // 2
    if sum(section) != half:
        raise ValueError(f"mrope_section {section} does not cover {half} rotary frequencies")
    parts: list[torch.Tensor] = []
    for base in (0, half):  # the cos half, then the sin half
        start = base
        for stream, width in enumerate(section):
            rows = cos_sin_cache.index_select(0, positions[stream])
            parts.append(rows[:, start : start + width])
            start += width
    return torch.cat(parts, dim=1)
