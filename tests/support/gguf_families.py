"""GGUF files of tiny random HF models of the non-Llama families (``qwen3moe``, ``gemma2``,
``gemma3``, ``phi3``), written the way llama.cpp's ``convert_hf_to_gguf.py`` does, and the
HF-named float32 weights each file holds (the reference).

Tensor names come from gguf-py's own HF -> GGUF table (``gguf.get_tensor_name_map``), not from
tokenwire's. As the converter does: Qwen3-MoE experts are stacked per layer
(``mlp.experts.gate_proj`` [E, I, H] ...), Gemma norm weights are stored as ``1 + w`` (the
reference is what a reader gets back: ``(1 + w) - 1`` in float32), Phi-3's fused ``qkv_proj``
and ``gate_up_proj`` stay fused, tied embeddings have no ``output`` tensor. Linear weights
(``*_proj``, experts) are stored as ``qtype``; the rest F32.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file

# GGUF architecture -> (tiny_models family, overrides): the families' tiny shapes.
QWEN3_MOE = dict(
    model_type="qwen3_moe", intermediate_size=96, num_experts=8, num_experts_per_tok=3,
    moe_intermediate_size=32, norm_topk_prob=True, head_dim=32,
)  # fmt: skip
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3moe": ("llama", QWEN3_MOE),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3_text", {}),
    "phi3": ("phi3", {}),
}
_ARCH = {
    "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
}
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")


def stack_experts(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``...experts.{e}.<proj>.weight`` -> ``...experts.<proj>.weight`` [E, ...] (the
    converter's merge); other tensors unchanged."""
    out: dict[str, np.ndarray] = {}
    groups: dict[str, dict[int, np.ndarray]] = {}
    for name, value in state.items():
        if m := _EXPERT.fullmatch(name):
            groups.setdefault(f"{m.group(1)}.{m.group(3)}.weight", {})[int(m.group(2))] = value
        else:
            out[name] = value
    for name, experts in groups.items():
        out[name] = np.stack([experts[e] for e in range(len(experts))])
    return out


def unstack_experts(name: str, value: np.ndarray) -> dict[str, np.ndarray]:
    stem, _, proj = name.removesuffix(".weight").rpartition(".")
    if not stem.endswith(".experts"):
        return {name: value}
    return {f"{stem}.{e}.{proj}.weight": value[e].copy() for e in range(value.shape[0])}


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The (global layers') rope parameters of a transformers 5 config."""
    params = dict(cfg.get("rope_parameters") or {})
    return dict(params.get("full_attention", params))


def _metadata(writer: gguf.GGUFWriter, arch: str, cfg: dict[str, Any]) -> None:
    """The keys llama.cpp's converter writes for ``arch`` (tokenizer aside)."""
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = _rope(cfg)
    writer.add_rope_freq_base(rope["rope_theta"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    if arch == "qwen3moe":
        writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma3" and rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
        writer.add_rope_scaling_attn_factors(1.0)  # max_position == original: no scaling
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)


def write_family_gguf(src: Path, out: Path, arch: str, qtype: QT) -> dict[str, torch.Tensor]:
    """Write the GGUF of the tiny HF model at ``src`` to ``out``; return the HF-named float32
    weights it holds (de-quantized by gguf-py; names as in ``src``)."""
    cfg = json.loads((src / "config.json").read_text())
    table = gguf.get_tensor_name_map(_ARCH[arch], cfg["num_hidden_layers"])
    state = stack_experts(
        {k: v.float().numpy() for k, v in load_file(src / "model.safetensors").items()}
    )
    writer = gguf.GGUFWriter(out, arch)
    _metadata(writer, arch, cfg)
    gemma = arch.startswith("gemma")
    reference: dict[str, torch.Tensor] = {}
    for hf, data in state.items():
        stem = hf.removesuffix(".weight")
        name = table.get_name(stem)
        assert name is not None, (arch, hf)
        linear = stem.endswith("_proj") and data.shape[-1] % 32 == 0
        if gemma and hf.endswith("norm.weight"):
            data = data + np.float32(1.0)
        if linear and qtype != QT.F32:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(f"{name}.weight", raw, raw_dtype=qtype)
            back = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        else:
            writer.add_tensor(f"{name}.weight", data)
            back = data
        if gemma and hf.endswith("norm.weight"):
            back = back - np.float32(1.0)
        for part, value in unstack_experts(hf, back).items():
            reference[part] = torch.from_numpy(np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference
