"""One GGUF tensor -> the HF tensors it holds (``names.hf_parts``), on the raw data.

A plain tensor is itself; Phi-3's fused ``attn_qkv`` splits its rows into q / k / v by the
head counts (``heads * d``, ``kv_heads * d``, ``kv_heads * d`` rows) and its ``ffn_up`` into
gate / up halves; a stacked experts tensor (Qwen3-MoE ``ffn_*_exps``) into one matrix per
expert along its leading axis. Quantized data splits the same way: its blocks run along each
row, so whole rows (and whole experts) keep their blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy.typing as npt

EXPERT = "{e}"  # the expert-index field of a stacked experts tensor's HF name


def split_parts(
    names: tuple[str, ...], data: npt.NDArray[Any], heads: tuple[int, int] | None
) -> Iterator[tuple[str, npt.NDArray[Any]]]:
    """``(hf_name, data)`` per HF tensor in ``data`` (``heads``: attention and KV head
    counts, needed to split a fused q/k/v tensor)."""
    if EXPERT in names[0]:
        if data.ndim < 2:
            raise ValueError(f"stacked experts tensor has shape {data.shape}")
        for e in range(data.shape[0]):
            yield names[0].format(e=e), data[e]
        return
    if len(names) == 1:
        yield names[0], data
        return
    offset = 0
    for name, rows in zip(names, _fused_rows(len(names), data.shape[0], heads), strict=True):
        yield name, data[offset : offset + rows]
        offset += rows


def _fused_rows(parts: int, rows: int, heads: tuple[int, int] | None) -> tuple[int, ...]:
    """Rows of each part of a fused tensor: q/k/v by head counts, gate/up in halves."""
    if parts == 2:
        if rows % 2:
            raise ValueError(f"fused gate/up tensor has an odd number of rows ({rows})")
        return rows // 2, rows // 2
    if parts != 3 or heads is None:
        raise ValueError(f"cannot split a fused tensor of {rows} rows into {parts} parts")
    q_heads, kv_heads = heads
    units = q_heads + 2 * kv_heads
    if rows % units:
        raise ValueError(
            f"fused q/k/v tensor's {rows} rows do not split into {q_heads} query and "
            f"2 x {kv_heads} key/value heads"
        )
    head_dim = rows // units
    return q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim
