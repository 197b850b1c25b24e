"""Mixture-of-experts config keys (Mixtral, Qwen2-MoE, Qwen3-MoE) -> ``MoESpec``.

The keys each family's HF implementation reads, with HF's defaults:

- Mixtral: ``num_local_experts`` (8), ``num_experts_per_tok`` (2); every layer is sparse, each
  expert's MLP is ``intermediate_size`` wide and the top-k softmax weights are always
  renormalised to sum to 1.
- Qwen2-MoE: ``num_experts`` (60), ``num_experts_per_tok`` (4), ``moe_intermediate_size``
  (1408), ``norm_topk_prob`` (False: the top-k weights stay softmax probabilities), a shared
  expert ``shared_expert_intermediate_size`` (5632) wide scaled by ``sigmoid(shared_expert_gate
  (x))``; ``decoder_sparse_step`` (1) and ``mlp_only_layers`` ([]) choose which layers stay
  dense (their MLP is ``intermediate_size`` wide): layer ``i`` is sparse when ``i`` is not in
  ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``.
- Qwen3-MoE: as Qwen2-MoE (defaults 128 experts, top 8, 768 wide) without a shared expert.
  transformers >= 5 writes ``num_local_experts`` for it; both names are read.
- gpt-oss: ``num_local_experts`` (128), ``num_experts_per_tok`` (4); every layer is sparse,
  each expert ``intermediate_size`` wide; the router has a bias and takes the softmax of the
  top-k logits; the experts have biases and run the clamped SwiGLU (``swiglu_alpha`` 1.702,
  ``swiglu_limit`` 7.0).
- Llama 4 (``Llama4ForCausalLM`` / ``Llama4ForConditionalGeneration``): ``num_local_experts``
  (16), ``num_experts_per_tok`` (1), each expert and the ungated shared expert
  ``intermediate_size`` (8192) wide (the dense layers: ``intermediate_size_mlp``);
  ``moe_layers`` (default every ``interleave_moe_layer_step``-th layer, from layer
  ``step - 1``) are sparse; the router's top-k logits through a sigmoid scale the chosen
  experts' *input*.

Values outside what the maths here implements are ``ValueError``s naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MIXTRAL = "MixtralForCausalLM"
QWEN2_MOE = "Qwen2MoeForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
GPT_OSS = "GptOssForCausalLM"
LLAMA4 = "Llama4ForCausalLM"
LLAMA4_MULTIMODAL = "Llama4ForConditionalGeneration"
LLAMA4_ARCHITECTURES = (LLAMA4, LLAMA4_MULTIMODAL)
MOE_ARCHITECTURES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE, GPT_OSS, *LLAMA4_ARCHITECTURES)

# architecture -> (experts, top-k, expert width, shared expert width) when the key is absent.
_DEFAULTS: dict[str, tuple[int, int, int, int]] = {
    MIXTRAL: (8, 2, 14336, 0),
    QWEN2_MOE: (60, 4, 1408, 5632),
    QWEN3_MOE: (128, 8, 768, 0),
    GPT_OSS: (128, 4, 2880, 0),
    LLAMA4: (16, 1, 8192, 8192),
    LLAMA4_MULTIMODAL: (16, 1, 8192, 8192),
}


@dataclass(frozen=True)
class DeepseekRouting:
    """DeepSeekMoE's router (``deepseek_config``): softmax (V2) or sigmoid (V3) scores; the
    top-k experts chosen within the ``topk_groups`` best of ``num_groups`` expert groups (a
    group ranked by its best score, or by the sum of its best two with ``group_top2_sum``);
    V3 adds ``e_score_correction_bias`` to the scores for the choice only; the chosen scores
    (renormalised when ``MoESpec.renormalize``) times ``routed_scaling_factor``."""

    sigmoid: bool
    num_groups: int
    topk_groups: int
    group_top2_sum: bool
    routed_scaling_factor: float
    correction_bias: bool


@dataclass(frozen=True)
class MoESpec:
    """The sparse MLP of a mixture-of-experts model."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each routed expert's MLP width
    renormalize: bool  # top-k weights rescaled to sum to 1 (Mixtral always; Qwen norm_topk_prob)
    # Qwen2-MoE: width of the shared expert every token goes through (0: none), its output
    # scaled by sigmoid(shared_expert_gate(x)).
    shared_expert_intermediate_size: int
    sparse_layers: tuple[bool, ...]  # per layer: sparse MoE block (True) or dense MLP
    # gpt-oss: a router bias, the softmax over the top-k logits only, expert biases and the
    # clamped SwiGLU with (alpha, limit) (None: the model's plain gated activation).
    router_bias: bool = False
    softmax_after_topk: bool = False
    expert_bias: bool = False
    swiglu: tuple[float, float] | None = None
    # gpt-oss: the checkpoint stores the experts in MXFP4 (quantization_config mxfp4); the
    # Triton path keeps them so (``gpt_oss_mxfp4``), the CPU de-quantizes them at load.
    mxfp4_experts: bool = False
    # Qwen2-MoE: the shared expert's output is scaled by sigmoid(shared_expert_gate(x));
    # Llama 4: added as is.
    shared_expert_gated: bool = True
    # Llama 4: the top-k router logits through a sigmoid scale each chosen expert's input
    # (not its output).
    sigmoid_input_scaling: bool = False
    # DeepSeek-V2/V3: grouped top-k routing (None: ``kernels.moe.select_experts``).
    deepseek: DeepseekRouting | None = None

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0


def moe_spec(cfg: Mapping[str, Any], architecture: str) -> MoESpec | None:
    """The model's ``MoESpec``; None for dense families (and a MoE config with 0 experts,
    which HF builds as all-dense layers)."""
    if architecture not in MOE_ARCHITECTURES:
        return None
    d_experts, d_top_k, d_width, d_shared = _DEFAULTS[architecture]
    n_layers = int(cfg["num_hidden_layers"])
    if architecture in LLAMA4_ARCHITECTURES:
        return _llama4_spec(cfg, n_layers)
    if architecture in (MIXTRAL, GPT_OSS):
        experts_key, width_key = "num_local_experts", "intermediate_size"
        renormalize = True
        sparse = [True] * n_layers
    else:
        experts_key = "num_experts" if "num_experts" in cfg else "num_local_experts"
        width_key = "moe_intermediate_size"
        renormalize = bool(cfg.get("norm_topk_prob", False))
        sparse = _qwen_sparse_layers(cfg, n_layers)
        if cfg.get("use_sliding_window"):
            raise ValueError(
                f"unsupported config: use_sliding_window=True for {architecture} "
                "(sliding-window attention is not implemented for Qwen MoE layers)"
            )
    num_experts = _int(cfg, experts_key, d_experts, minimum=0)
    if num_experts == 0:
        return None
    top_k = _int(cfg, "num_experts_per_tok", d_top_k, minimum=1)
    if top_k > num_experts:
        raise ValueError(
            f"num_experts_per_tok={top_k} exceeds the {num_experts} experts ({experts_key})"
        )
    shared = 0
    if architecture == QWEN2_MOE:
        shared = _int(cfg, "shared_expert_intermediate_size", d_shared, minimum=1)
    gpt_oss = architecture == GPT_OSS
    swiglu = None
    if gpt_oss:
        swiglu = (float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)))
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=_int(cfg, width_key, d_width, minimum=1),
        renormalize=renormalize,
        shared_expert_intermediate_size=shared,
        sparse_layers=tuple(sparse),
        router_bias=gpt_oss,
        softmax_after_topk=gpt_oss,
        expert_bias=gpt_oss,
        swiglu=swiglu,
        mxfp4_experts=gpt_oss and _quant_method(cfg) == "mxfp4",
    )


def _quant_method(cfg: Mapping[str, Any]) -> str | None:
    qc = cfg.get("quantization_config")
    return qc.get("quant_method") if isinstance(qc, Mapping) else None


def _llama4_spec(cfg: Mapping[str, Any], n_layers: int) -> MoESpec | None:
    d_experts, d_top_k, d_width, _ = _DEFAULTS[LLAMA4]
    num_experts = _int(cfg, "num_local_experts", d_experts, minimum=0)
    if num_experts == 0:
        return None
    top_k = _int(cfg, "num_experts_per_tok", d_top_k, minimum=1)
    if top_k > num_experts:
        raise ValueError(
            f"num_experts_per_tok={top_k} exceeds the {num_experts} experts (num_local_experts)"
        )
    width = _int(cfg, "intermediate_size", d_width, minimum=1)
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=width,
        renormalize=False,
        shared_expert_intermediate_size=width,
        sparse_layers=tuple(_llama4_sparse_layers(cfg, n_layers)),
        shared_expert_gated=False,
        sigmoid_input_scaling=True,
    )


def _llama4_sparse_layers(cfg: Mapping[str, Any], n_layers: int) -> list[bool]:
    """HF's ``moe_layers``, default ``range(step - 1, n, step)``."""
    layers = cfg.get("moe_layers")
    if layers is None:
        step = _int(cfg, "interleave_moe_layer_step", 1, minimum=1)
        layers = list(range(step - 1, n_layers, step))
    for layer in layers:
        if not isinstance(layer, int) or not 0 <= layer < n_layers:
            raise ValueError(f"moe_layers lists {layer!r}, not a layer index in [0, {n_layers})")
    return [i in layers for i in range(n_layers)]


def _qwen_sparse_layers(cfg: Mapping[str, Any], n_layers: int) -> list[bool]:
    step = _int(cfg, "decoder_sparse_step", 1, minimum=1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list | tuple):
        raise ValueError(f"mlp_only_layers must be a list of layer indices, got {dense!r}")
    for layer in dense:
        if not isinstance(layer, int) or not 0 <= layer < n_layers:
            raise ValueError(
                f"mlp_only_layers lists {layer!r}, not a layer index in [0, {n_layers})"
            )
    return [i not in dense and (i + 1) % step == 0 for i in range(n_layers)]


def _int(cfg: Mapping[str, Any], key: str, default: int, *, minimum: int) -> int:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"unsupported config: {key}={value!r} (an integer >= {minimum})")
    return value
