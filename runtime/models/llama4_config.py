"""Llama 4 text config keys -> ``ModelArch`` fields (``Llama4TextConfig``'s defaults).

- ``no_rope_layers`` (default: ``1`` except every ``no_rope_layer_interval``-th layer, 4):
  ``1`` rotates q/k, ``0`` is a NoPE layer (no rotary).
- ``layer_types`` (default: ``chunked_attention`` on the rope layers when
  ``attention_chunk_size`` is set, else ``full_attention``): a chunked layer's query at
  position ``p`` sees keys in ``[p // C * C, p]``, ``C = attention_chunk_size`` (8192).
- ``use_qk_norm`` (True): a weightless RMS norm of q and k after rotary, on rope layers only.
- ``attn_temperature_tuning`` (True), ``floor_scale`` (8192), ``attn_scale`` (0.1): NoPE
  layers scale q by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``.
- Dense layers are ``intermediate_size_mlp`` (16384) wide (the experts: ``moe_config``).
- The checkpoint's q/k rows rotate interleaved pairs (HF's complex rotary): permuted at load
  time (``llama4_checkpoint``) to the half-split layout of ``kernels.rotary``.

``Llama4ForConditionalGeneration``'s config.json nests the text model under
``text_config``: ``text_view`` lifts it (the vision tower is not served).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenwire.runtime.models.moe_config import LLAMA4, LLAMA4_MULTIMODAL

DEFAULT_ROPE_THETA = 500000.0
_CHUNKED = "chunked_attention"
_LAYER_TYPES = (_CHUNKED, "full_attention")


def text_view(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """A ``Llama4ForConditionalGeneration`` config.json -> its text model's keys (with the
    multimodal architecture name kept); any other config unchanged."""
    archs = cfg.get("architectures") or []
    multimodal = (archs and archs[0] == LLAMA4_MULTIMODAL) or cfg.get("model_type") == "llama4"
    if not multimodal:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(f"{LLAMA4_MULTIMODAL} config.json has no text_config")
    return {**text, "architectures": [LLAMA4_MULTIMODAL], "model_type": "llama4_text"}


def llama4_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The Llama 4 specific ``ModelArch`` fields (see the module doc)."""
    n = int(cfg["num_hidden_layers"])
    rope_layers = _rope_layers(cfg, n)
    chunk = cfg.get("attention_chunk_size", 8192)
    types = cfg.get("layer_types")
    if types is None:
        types = [_CHUNKED if r and chunk is not None else "full_attention" for r in rope_layers]
    if len(types) != n or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must list {n} of {_LAYER_TYPES}, got {types!r}")
    if _CHUNKED in types and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"unsupported config: attention_chunk_size={chunk!r} (an integer >= 1)")
    temperature = None
    if cfg.get("attn_temperature_tuning", True):
        temperature = (float(cfg.get("floor_scale", 8192)), float(cfg.get("attn_scale", 0.1)))
    return dict(
        intermediate_size=int(cfg.get("intermediate_size_mlp", 16384)),
        layer_attention_chunk=tuple(int(chunk) if t == _CHUNKED else None for t in types),
        layer_rope=rope_layers,
        qk_l2_norm=bool(cfg.get("use_qk_norm", True)),
        attn_temperature=temperature,
        interleaved_rope_checkpoint=True,
    )


def _rope_layers(cfg: Mapping[str, Any], n: int) -> tuple[bool, ...]:
    layers = cfg.get("no_rope_layers")
    if not layers:  # HF: None or [] means the default
        interval = int(cfg.get("no_rope_layer_interval", 4))
        return tuple((i + 1) % interval != 0 for i in range(n))
    if len(layers) != n:
        raise ValueError(f"no_rope_layers lists {len(layers)} layers, num_hidden_layers is {n}")
    return tuple(bool(x) for x in layers)


def is_llama4(architecture: str) -> bool:
    return architecture in (LLAMA4, LLAMA4_MULTIMODAL)
