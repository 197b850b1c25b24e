"""GGUF tensor names -> HF parameter names, per GGUF architecture, and llama.cpp's q/k row order.

Covers the GGUF architectures tokenwire serves (``families.FAMILIES``: ``llama`` -- also
Mistral and SmolLM --, ``qwen2``, ``qwen3``, ``qwen3moe``, ``gemma2``, ``gemma3``, ``phi3``),
following llama.cpp's standard tensor names (``blk.N.attn_q.weight`` ...). A GGUF tensor is
one HF parameter, or several: Phi-3's fused ``attn_qkv`` / ``ffn_up`` (q/k/v and gate/up rows)
and Qwen3-MoE's stacked ``ffn_{gate,up,down}_exps`` (one matrix per expert); ``hf_parts``
says which. llama.cpp's converter permutes the output rows of Llama q/k projections (its rotary
pairs adjacent elements, HF's pairs the two halves of a head); ``hf_row_order`` undoes it.
"""

from __future__ import annotations

import re

import numpy as np
import numpy.typing as npt

from tokenwire.runtime.loader.gguf.families import FAMILIES, GLOBAL, Family

# Tensors with no HF parameter: rope frequency factors come from the config (Phi-3's LongRoPE
# factors: ``config.hf_config_keys``).
IGNORED: frozenset[str] = frozenset(
    {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
)

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def family(arch: object) -> Family:
    """The tables of GGUF ``general.architecture`` ``arch``; ValueError naming it if unknown."""
    if not isinstance(arch, str) or arch not in FAMILIES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(FAMILIES))})"
        )
    return FAMILIES[arch]


def hf_parts(gguf_name: str, arch: str | None = None) -> tuple[str, ...]:
    """The HF parameter names GGUF tensor ``gguf_name`` holds, in storage order: one name, the
    fused parts (rows) of a Phi-3 ``attn_qkv`` / ``ffn_up``, or for a stacked experts tensor
    the projection of expert ``{e}`` (a ``str.format`` field for the expert index).

    ``arch`` None: the first family that knows the tensor (llama's meaning of ``ffn_norm``);
    enough for callers that look only at linear weights. ValueError if none does."""
    families = (family(arch),) if arch is not None else tuple(FAMILIES.values())
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        for fam in families:
            if part in fam.experts:
                return (f"model.layers.{layer}.mlp.experts.{{e}}.{fam.experts[part]}.{kind}",)
            if part in fam.fused:
                return tuple(f"model.layers.{layer}.{p}.{kind}" for p in fam.fused[part])
            if part in fam.block:
                return (f"model.layers.{layer}.{fam.block[part]}.{kind}",)
    elif (m := _GLOBAL_RE.fullmatch(gguf_name)) and m.group(1) in GLOBAL:
        return (f"{GLOBAL[m.group(1)]}.{m.group(2)}",)
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF parameter name")


def hf_name(gguf_name: str, arch: str | None = None) -> str:
    """The HF parameter name of GGUF tensor ``gguf_name`` (of its first part -- expert 0 -- when
    it holds several, see ``hf_parts``); ValueError if it has none."""
    return hf_parts(gguf_name, arch)[0].format(e=0)


def is_norm(gguf_name: str) -> bool:
    """Whether ``gguf_name`` is an RMSNorm weight (``*_norm.weight``, ``output_norm.weight``)."""
    return gguf_name.endswith("norm.weight")


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
