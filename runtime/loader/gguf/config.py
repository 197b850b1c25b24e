"""HF config.json keys from a GGUF file's metadata that transformers' GGUF conversion misses.

tokenwire's GGUF -> HF conversion (``loader.gguf_convert``) takes the config from
transformers, whose GGUF table (transformers 5.x) reads no ``qwen3moe.expert_feed_forward_length``
(``moe_intermediate_size`` falls back to 768), no Gemma 2 soft-caps (50 / 30 by default), no
Gemma query scale, no Gemma 3 rope scaling and no Phi-3 LongRoPE (its factors are the
``rope_factors_long`` / ``rope_factors_short`` tensors). ``hf_config_keys`` reads them the way
llama.cpp writes them (``convert_hf_to_gguf.py``); merged over transformers' config they give
the source model's config (``tests/runtime/test_gguf_families.py``).

Gemma's query scale is not in the file: llama.cpp scales queries by ``head_dim ** -0.5``,
except for the 27B models (46 Gemma 2 / 62 Gemma 3 layers), ``(hidden / heads) ** -0.5``;
``query_pre_attn_scalar`` follows the same rule. llama.cpp fixes Gemma 3's local layers at
every 6th layer global (``sliding_window_pattern`` 6) and their rope base at 1e4 (HF's default).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenwire.runtime.loader.gguf.container import GGUFFile, open_gguf

_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_PATTERN = 6


def hf_config_keys(path: Path) -> dict[str, Any]:
    """The HF config keys of the GGUF at ``path`` that transformers' conversion does not set
    (empty for an architecture that needs none)."""
    gguf = open_gguf(path)
    arch = gguf.metadata.get("general.architecture")
    if arch == "qwen3moe":
        return _qwen3moe(gguf.metadata, arch)
    if arch in _GEMMA_27B_LAYERS:
        return _gemma(gguf.metadata, arch)
    if arch == "phi3":
        return _phi3(gguf, arch)
    return {}


def _present(metadata: Mapping[str, Any], arch: str, keys: Mapping[str, str]) -> dict[str, Any]:
    """HF key -> value of GGUF key ``{arch}.<key>``, for those the file has."""
    return {hf: metadata[f"{arch}.{k}"] for hf, k in keys.items() if f"{arch}.{k}" in metadata}


def _qwen3moe(metadata: Mapping[str, Any], arch: str) -> dict[str, Any]:
    keys = {
        "num_experts": "expert_count",
        "num_experts_per_tok": "expert_used_count",
        "moe_intermediate_size": "expert_feed_forward_length",
        "head_dim": "attention.key_length",
    }
    return _present(metadata, arch, keys)


def _gemma(metadata: Mapping[str, Any], arch: str) -> dict[str, Any]:
    keys = {
        "head_dim": "attention.key_length",
        "sliding_window": "attention.sliding_window",
        "attn_logit_softcapping": "attn_logit_softcapping",
        "final_logit_softcapping": "final_logit_softcapping",
    }
    out = _present(metadata, arch, keys)
    hidden = metadata.get(f"{arch}.embedding_length")
    heads = metadata.get(f"{arch}.attention.head_count")
    if metadata.get(f"{arch}.block_count") == _GEMMA_27B_LAYERS[arch] and hidden and heads:
        out["query_pre_attn_scalar"] = hidden // heads
    elif "head_dim" in out:
        out["query_pre_attn_scalar"] = out["head_dim"]
    if arch == "gemma3":
        out["sliding_window_pattern"] = _GEMMA3_PATTERN
        if metadata.get(f"{arch}.rope.scaling.type") == "linear":
            factor = float(metadata[f"{arch}.rope.scaling.factor"])
            out["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return out


def _phi3(gguf: GGUFFile, arch: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    window = gguf.metadata.get(f"{arch}.attention.sliding_window")
    if window is not None:  # llama.cpp writes 0 for none
        out["sliding_window"] = int(window) or None
    factors = {
        info.name: [float(x) for x in gguf.tensor_data(info).reshape(-1)]
        for info in gguf.tensors
        if info.name in ("rope_factors_long.weight", "rope_factors_short.weight")
    }
    if len(factors) == 2:
        original = gguf.metadata.get(f"{arch}.rope.scaling.original_context_length")
        if not isinstance(original, int):
            raise ValueError(
                f"GGUF has LongRoPE factors but no {arch}.rope.scaling.original_context_length"
            )
        out["original_max_position_embeddings"] = original
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": factors["rope_factors_long.weight"],
            "short_factor": factors["rope_factors_short.weight"],
            "original_max_position_embeddings": original,
        }
    return out
