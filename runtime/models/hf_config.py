"""Hugging Face config.json keys -> ``ModelArch`` fields, family by family.

Every key a family's HF implementation reads is read here, with HF's defaults for keys a
config.json may omit (Gemma ties its embeddings unless told otherwise; Gemma 3's global and
local rope bases default to 1e6 and 1e4). Both config styles are accepted: transformers >= 5
(``rope_parameters``, per layer type for Gemma 3; explicit ``layer_types``) and the older
files on the Hub (``rope_theta`` + ``rope_scaling``, ``rope_local_base_freq``,
``sliding_window_pattern``, the even/odd rule of Gemma 2). Keys whose maths is not
implemented raise ``ValueError`` naming the key. The mixture-of-experts keys (Mixtral,
Qwen2-MoE, Qwen3-MoE) are read by ``moe_config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenwire.runtime.models.deepseek_config import deepseek_fields, is_deepseek
from tokenwire.runtime.models.llama4_config import DEFAULT_ROPE_THETA as _LLAMA4_THETA
from tokenwire.runtime.models.llama4_config import is_llama4, llama4_fields
from tokenwire.runtime.models.moe_config import GPT_OSS, QWEN2_MOE, QWEN3_MOE, moe_spec

# HF activation names (``hidden_act`` / ``hidden_activation``) the gated MLP supports: the
# kernels' ``GATED_ACTIVATIONS`` (``kernels/activation.py``;
# ``tests/project/test_layering.py`` checks the two agree). Not imported from there: model
# facts stay torch-free.
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_DEFAULT_ROPE_THETA = 10000.0
_GEMMA3_GLOBAL_THETA = 1_000_000.0
_GEMMA3_LOCAL_THETA = 10_000.0
_GEMMA3_DEFAULT_PATTERN = 6
_QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28
_SLIDING = "sliding_attention"
_RopeScaling = tuple[tuple[str, Any], ...] | None


def family_fields(cfg: Mapping[str, Any], architecture: str) -> dict[str, Any]:
    """The family-dependent ``ModelArch`` fields (everything but shapes and token ids)."""
    check_supported_features(cfg, architecture)
    gemma = architecture in GEMMA
    gemma2 = architecture == "Gemma2ForCausalLM"
    theta, scaling, local_theta = rope(cfg, architecture)
    windows = layer_sliding_windows(cfg, architecture)
    bias = bool(cfg.get("attention_bias") or False)
    llama_bias = architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM", QWEN3_MOE) or gemma
    llama_bias = llama_bias or is_llama4(architecture)
    if architecture == GPT_OSS:  # HF's GptOssConfig defaults attention_bias to True
        bias = bool(cfg.get("attention_bias", True))
        llama_bias = True
    # Qwen2 always has q/k/v biases; Qwen2-MoE unless qkv_bias says otherwise (HF >= 5).
    qkv_bias = architecture == "Qwen2ForCausalLM" or (
        architecture == QWEN2_MOE and bool(cfg.get("qkv_bias", True))
    )
    fields: dict[str, Any] = dict(
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        attention_bias=qkv_bias or (llama_bias and bias),
        o_proj_bias=llama_bias and bias,
        qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", QWEN3_MOE),
        sliding_window=max((w for w in windows if w is not None), default=None),
        layer_sliding_window=windows,
        hidden_act=hidden_act(cfg, architecture),
        fused_checkpoint_projections=architecture == "Phi3ForCausalLM",
        moe=moe_spec(cfg, architecture),
        attention_sinks=architecture == GPT_OSS,
    )
    if is_llama4(architecture):
        fields.update(llama4_fields(cfg))
    if is_deepseek(architecture):
        scaling_dict = None if scaling is None else dict(scaling)
        fields.update(deepseek_fields(cfg, architecture, scaling_dict))
    if gemma:
        fields.update(
            norm_unit_offset=True,
            sandwich_norms=True,
            embed_scale=float(cfg["hidden_size"]) ** 0.5,
            attn_scale=float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
            # HF's Gemma 3 never passes attn_logit_softcapping to its attention.
            attn_logit_softcap=_optional_float(cfg.get("attn_logit_softcapping"))
            if gemma2
            else None,
            final_logit_softcap=_optional_float(cfg.get("final_logit_softcapping")),
            sliding_rope_theta=local_theta,
        )
    return fields


def hidden_act(cfg: Mapping[str, Any], architecture: str) -> str:
    """The MLP's gate activation; Gemma reads ``hidden_activation`` (HF ignores its
    ``hidden_act``), every other family ``hidden_act``."""
    key = "hidden_act"
    if architecture in GEMMA:
        key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
        act = cfg.get(key) or "gelu_pytorch_tanh"
    else:
        act = cfg.get(key) or "silu"
    if act not in GATED_ACTIVATIONS:
        raise ValueError(
            f"unsupported {key} {act!r} for {architecture}; implemented: "
            + ", ".join(GATED_ACTIVATIONS)
        )
    return str(act)


def check_supported_features(cfg: Mapping[str, Any], architecture: str) -> None:
    if cfg.get("mlp_bias"):
        raise ValueError("unsupported config: mlp_bias=True is not implemented")
    params = dict(cfg.get("rope_parameters") or {})
    nested = [v for v in params.values() if isinstance(v, Mapping)]
    for source in (cfg, dict(cfg.get("rope_scaling") or {}), params, *nested):
        if float(source.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError(
                "unsupported config: partial_rotary_factor != 1.0 (rope on part of each head)"
            )
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(
            "unsupported config: use_bidirectional_attention=True (tokenwire serves causal LMs)"
        )


def rope(cfg: Mapping[str, Any], architecture: str) -> tuple[float, _RopeScaling, float | None]:
    """(rope theta, rope scaling, local rope theta of sliding layers or None).

    Gemma 3 rotates its sliding-window layers with ``rope_local_base_freq`` (plain rope) and
    its global layers with ``rope_theta`` + ``rope_scaling``; every other family has one rope.
    """
    params = dict(cfg.get("rope_parameters") or {})
    if architecture == "Gemma3ForCausalLM":
        return _gemma3_rope(cfg, params)
    merged = {**dict(cfg.get("rope_scaling") or {}), **params}
    default_theta = _LLAMA4_THETA if is_llama4(architecture) else _DEFAULT_ROPE_THETA
    theta, scaling = _one_rope(merged, cfg.get("rope_theta") or default_theta)
    if scaling is None:
        return theta, None, None
    scaling_dict = dict(scaling)
    if architecture == "Phi3ForCausalLM" and scaling_dict["rope_type"] in ("su", "yarn"):
        scaling_dict["rope_type"] = "longrope"  # legacy names; HF's Phi3Config renames them
    if scaling_dict["rope_type"] == "longrope":
        return theta, _longrope(cfg, scaling_dict), None
    if scaling_dict["rope_type"] == "yarn" and scaling_dict.get("factor") is None:
        original = scaling_dict.get("original_max_position_embeddings")
        if original is None:
            raise ValueError("rope_type 'yarn' needs original_max_position_embeddings")
        scaling_dict["factor"] = float(cfg["max_position_embeddings"]) / int(original)
        return theta, tuple(sorted(scaling_dict.items())), None
    return theta, scaling, None


def _one_rope(merged: dict[str, Any], default_theta: float) -> tuple[float, _RopeScaling]:
    """One rope's (theta, scaling) from a merged ``rope_parameters``/``rope_scaling`` dict."""
    merged = dict(merged)
    theta = merged.pop("rope_theta", None) or default_theta
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type == "default":
        return float(theta), None
    merged["rope_type"] = rope_type
    return float(theta), tuple(sorted(merged.items()))


def _longrope(cfg: Mapping[str, Any], params: dict[str, Any]) -> _RopeScaling:
    """LongRoPE needs the pretraining length (Phi-3's top-level key wins, as in HF) and a
    ``factor`` (default: ``max_position_embeddings / original_max_position_embeddings``)."""
    original = cfg.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings"
    )
    if original is None:
        raise ValueError("rope_type 'longrope' needs original_max_position_embeddings")
    params["original_max_position_embeddings"] = int(original)
    if params.get("factor") is None:
        params["factor"] = float(cfg["max_position_embeddings"]) / int(original)
    return tuple(sorted(params.items()))


def _gemma3_rope(
    cfg: Mapping[str, Any], params: dict[str, Any]
) -> tuple[float, _RopeScaling, float | None]:
    if "full_attention" in params or _SLIDING in params:  # transformers >= 5
        full = dict(params.get("full_attention") or {})
        local = dict(params.get(_SLIDING) or {})
    else:
        full = {**dict(cfg.get("rope_scaling") or {}), **params}
        full.setdefault("rope_theta", cfg.get("rope_theta"))
        local = {"rope_theta": cfg.get("rope_local_base_freq")}
    theta, scaling = _one_rope(full, cfg.get("rope_theta") or _GEMMA3_GLOBAL_THETA)
    local_theta, local_scaling = _one_rope(local, _GEMMA3_LOCAL_THETA)
    if local_scaling is not None:
        raise ValueError("unsupported config: rope scaling on Gemma 3's sliding-window layers")
    return theta, scaling, local_theta


def layer_sliding_windows(cfg: Mapping[str, Any], architecture: str) -> tuple[int | None, ...]:
    """Each layer's attention window in tokens (None: full attention), as HF assigns them.

    Mistral and Phi-3 window every layer; Qwen2/3, Gemma 2/3 and gpt-oss follow
    ``layer_types`` when the config lists them, else HF's rule: Qwen layers from
    ``max_window_layers`` on (only with ``use_sliding_window``), Gemma 2 and gpt-oss every
    even layer, Gemma 3 all but every ``sliding_window_pattern``-th layer.
    """
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    if architecture.startswith("Qwen") and not cfg.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window that only use_sliding_window turns on
    if window is None:
        return (None,) * n
    if architecture not in (*GEMMA, GPT_OSS) and not architecture.startswith("Qwen"):
        return (int(window),) * n
    types = cfg.get("layer_types")
    if types is None:
        sliding = [_default_is_sliding(cfg, architecture, i) for i in range(n)]
    elif len(types) != n:
        raise ValueError(f"layer_types lists {len(types)} layers, num_hidden_layers is {n}")
    else:
        sliding = [t == _SLIDING for t in types]
    return tuple(int(window) if s else None for s in sliding)


def _default_is_sliding(cfg: Mapping[str, Any], architecture: str, layer: int) -> bool:
    if architecture in ("Gemma2ForCausalLM", GPT_OSS):
        return (layer + 1) % 2 != 0
    if architecture == "Gemma3ForCausalLM":
        pattern = cfg.get("sliding_window_pattern") or _GEMMA3_DEFAULT_PATTERN
        return (layer + 1) % int(pattern) != 0
    return layer >= int(cfg.get("max_window_layers") or _QWEN_DEFAULT_MAX_WINDOW_LAYERS)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
