"""Tiny random DeepSeek-V2/V3 checkpoints built from transformers' own config classes.

Every parameter is drawn N(0, 0.2) (vectors N(0, 0.05)), norm weights around 1, and V3's
``e_score_correction_bias`` buffers N(0, 0.1), so the correction bias changes the routing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 512
_MLA: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, first_k_dense_replace=1,
    kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
    max_position_embeddings=512,
)  # fmt: skip
# V3: q_lora, sigmoid scores + correction bias, 2 of 4 groups, top-2, 1 shared expert.
V3: dict[str, Any] = dict(
    _MLA, model_type="deepseek_v3", q_lora_rank=48, n_shared_experts=1, num_experts_per_tok=2,
    n_group=4, topk_group=2, routed_scaling_factor=2.5,
)  # fmt: skip
# V2 without q_lora: softmax scores, group-limited top-3 (2 of 4 groups), 2 shared experts.
V2: dict[str, Any] = dict(
    _MLA, model_type="deepseek_v2", q_lora_rank=None, n_shared_experts=2, num_experts_per_tok=3,
    topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
)  # fmt: skip
# DeepSeek's YaRN: the attention scale gains mscale(factor, mscale_all_dim) ** 2.
YARN: dict[str, Any] = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
    "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 64,
}  # fmt: skip


def build_tiny_deepseek(out_dir: Path, family: dict[str, Any], seed: int = 0) -> Path:
    """Save a random model of ``family`` (``V2``/``V3`` plus overrides) to ``out_dir``."""
    kwargs = dict(family)
    config = AutoConfig.for_model(
        kwargs.pop("model_type"), vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, **kwargs,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.2 if param.dim() > 1 else 0.05)
            if name.endswith("norm.weight"):
                param.add_(1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
