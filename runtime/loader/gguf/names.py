"""GGUF tensor names -> HF parameter names, and the q/k row order llama.cpp permuted.

Covers the GGUF architectures tokenwire serves (``llama`` -- also Mistral and SmolLM --,
``qwen2``, ``qwen3``), following llama.cpp's standard tensor names (``blk.N.attn_q.weight``
...). llama.cpp's converter permutes the output rows of Llama q/k projections (its rotary
pairs adjacent elements, HF's pairs the two halves of a head); ``hf_row_order`` undoes it.
"""

from __future__ import annotations

import re

import numpy as np
import numpy.typing as npt

# GGUF ``general.architecture`` -> whether q/k rows were permuted by the converter.
PERMUTED_QK: dict[str, bool] = {"llama": True, "qwen2": False, "qwen3": False}

_GLOBAL: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors with no HF parameter: rope frequency factors are recomputed from the config.
IGNORED: frozenset[str] = frozenset({"rope_freqs.weight"})

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """The HF parameter name of GGUF tensor ``gguf_name``; ValueError if it has none."""
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if part in _BLOCK:
            return f"model.layers.{layer}.{_BLOCK[part]}.{kind}"
    elif (m := _GLOBAL_RE.fullmatch(gguf_name)) and m.group(1) in _GLOBAL:
        return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF parameter name")


def qk_heads(gguf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """Head count whose rows llama.cpp permuted in ``gguf_name``; None if not a q/k tensor."""
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None:
        return None
    return {"attn_q": num_heads, "attn_k": num_kv_heads}.get(m.group(2))


def hf_row_order(rows: int, heads: int) -> npt.NDArray[np.intp]:
    """Index ``perm`` with ``hf_tensor = gguf_tensor[perm]`` for a permuted q/k projection.

    llama.cpp stored, per head, rows (0, d, 1, d + 1, ...) of HF's (0, 1, ..., 2d - 1): HF row
    ``i`` of a head is GGUF row ``2i`` for ``i < d`` and ``2(i - d) + 1`` otherwise.
    """
    if heads <= 0 or rows % (2 * heads):
        raise ValueError(f"{rows} rows do not split into {heads} heads of even size")
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)
