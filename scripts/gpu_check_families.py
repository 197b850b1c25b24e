"""Smoke stand-ins of issue 32's bundled configs for ``gpu_check.py --smoke``: each bundled
config.json shrunk to the tiny Llama's sizes (``SMOKE_CONFIG``), its family's features kept
(MLA, DeepSeekMoE routing; sinks, windows, gpt-oss's MoE)."""

from __future__ import annotations

import json
from typing import Any

from gpu_check_stages import REPO, SMOKE_CONFIG

# Smoke stand-ins of issue 32's bundled configs: the bundled file with these sizes on top.
_SMOKE_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mla": ("deepseek-v2-lite", {
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "num_key_value_heads": 4,
    }),
    "gpt-oss": ("gpt-oss-20b", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16,
        "head_dim": 16, "num_key_value_heads": 2,
    }),
}  # fmt: skip
_SHRUNK_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
)


def tiny_family_config(family: str) -> dict[str, Any]:
    """The bundled config of ``family`` (``_SMOKE_FAMILIES``) at ``SMOKE_CONFIG``'s sizes
    (read from the repo: the orchestrator runs without tokenwire importable)."""
    name, sizes = _SMOKE_FAMILIES[family]
    path = REPO / "runtime" / "loader" / "model_configs" / name / "config.json"
    config: dict[str, Any] = json.loads(path.read_text())
    config.update({key: SMOKE_CONFIG[key] for key in _SHRUNK_KEYS}, **sizes)
    return config
