"""DeepSeek-V2 / V3 config keys -> ``ModelArch`` fields (``DeepseekV2Config`` /
``DeepseekV3Config``'s defaults).

Multi-head latent attention (``MLASpec``): ``q_lora_rank`` (None: a plain ``q_proj``),
``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``. The paged cache
holds one "head" per token: the normed latent ``c_kv`` and the rotated ``k_pe``, so the
model's cache ``head_dim`` is ``kv_lora_rank + qk_rope_head_dim`` with one KV head and no
separate V (``ModelArch.kv_cache_parts`` is 1). The attention scale is
``(qk_nope + qk_rope) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN
(HF's ``yarn_apply_mscale``). The rope part rotates interleaved pairs (V2 always; V3 unless
``rope_interleave`` is False): permuted at load time (``deepseek_checkpoint``).

DeepSeekMoE (``DeepseekRouting`` in the ``MoESpec``): ``n_routed_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``, ``n_shared_experts`` ungated shared
experts (one MLP ``n_shared_experts * moe_intermediate_size`` wide), layers from
``first_k_dense_replace`` on sparse (the others dense, ``intermediate_size`` wide),
``routed_scaling_factor`` on the routed weights. V2: softmax scores, ``topk_method`` greedy
or ``group_limited_greedy`` (groups ranked by their best expert), no renormalisation (HF's V2
ignores ``norm_topk_prob``). V3: sigmoid scores plus ``e_score_correction_bias`` for the
choice only, groups ranked by the sum of their best two, ``norm_topk_prob`` (default True).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenwire.runtime.models.moe_config import DeepseekRouting, MoESpec

DEEPSEEK_V2 = "DeepseekV2ForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
DEEPSEEK_ARCHITECTURES = (DEEPSEEK_V2, DEEPSEEK_V3)


@dataclass(frozen=True)
class MLASpec:
    """The shapes of multi-head latent attention."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # The checkpoint's rope rows rotate interleaved pairs (permuted at load time).
    interleaved_rope: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Cached features per token and layer: the latent plus the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def is_deepseek(architecture: str) -> bool:
    return architecture in DEEPSEEK_ARCHITECTURES


def deepseek_fields(
    cfg: Mapping[str, Any], architecture: str, rope_scaling: dict[str, Any] | None
) -> dict[str, Any]:
    """The DeepSeek specific ``ModelArch`` fields (see the module doc)."""
    v3 = architecture == DEEPSEEK_V3
    if cfg.get("attention_bias"):
        raise ValueError("unsupported config: attention_bias=True for DeepSeek MLA")
    q_lora = cfg.get("q_lora_rank", 1536)
    mla = MLASpec(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)),
        v_head_dim=int(cfg.get("v_head_dim") or 128),
        interleaved_rope=bool(cfg.get("rope_interleave", True)) if v3 else True,
    )
    scale = float(mla.qk_head_dim) ** -0.5
    if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
        scale = scale * mscale * mscale
    return dict(
        mla=mla,
        head_dim=mla.latent_dim,
        num_key_value_heads=1,
        attn_scale=scale,
        moe=deepseek_moe_spec(cfg, v3),
    )


def yarn_mscale(scale: float, mscale: float) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek_moe_spec(cfg: Mapping[str, Any], v3: bool) -> MoESpec | None:
    n_layers = int(cfg["num_hidden_layers"])
    num_experts = int(cfg.get("n_routed_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if num_experts == 0 or top_k == 0:
        return None
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} exceeds the {num_experts} experts")
    first_dense = int(cfg.get("first_k_dense_replace", 3 if v3 else 0) or 0)
    freq = int(cfg.get("moe_layer_freq", 1) or 1)
    if freq != 1:
        raise ValueError(f"unsupported config: moe_layer_freq={freq} (HF implements 1)")
    width = int(cfg.get("moe_intermediate_size", 2048 if v3 else 1407))
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=width,
        renormalize=bool(cfg.get("norm_topk_prob", True)) if v3 else False,
        shared_expert_intermediate_size=width * int(cfg.get("n_shared_experts") or 0),
        sparse_layers=tuple(i >= first_dense for i in range(n_layers)),
        shared_expert_gated=False,
        deepseek=_routing(cfg, v3, num_experts),
    )


def _routing(cfg: Mapping[str, Any], v3: bool, num_experts: int) -> DeepseekRouting:
    scoring = cfg.get("scoring_func")
    if scoring is not None and scoring != ("sigmoid" if v3 else "softmax"):
        raise ValueError(
            f"unsupported config: scoring_func={scoring!r} (HF's DeepSeek-{'V3' if v3 else 'V2'} "
            f"scores with {'sigmoid' if v3 else 'softmax'})"
        )
    method = "noaux_tc" if v3 else str(cfg.get("topk_method") or "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"unsupported config: topk_method={method!r}")
    groups, topk_groups = 1, 1
    if method != "greedy":
        groups = int(cfg.get("n_group") or (8 if v3 else 1))
        topk_groups = int(cfg.get("topk_group") or (4 if v3 else 1))
        if num_experts % groups or not 1 <= topk_groups <= groups:
            raise ValueError(
                f"unsupported config: n_group={groups}, topk_group={topk_groups} for "
                f"{num_experts} experts (n_group must divide them; 1 <= topk_group <= n_group)"
            )
    return DeepseekRouting(
        sigmoid=v3,
        num_groups=groups,
        topk_groups=topk_groups,
        group_top2_sum=v3,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        correction_bias=v3,
    )
