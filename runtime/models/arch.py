"""Model architecture description derived from a Hugging Face config.

``ModelArch`` is the only thing the model implementation reads: every family difference
(GQA, qkv bias, q/k norm, tied embeddings, rope scaling, Gemma's norms, soft-capping and
per-layer windows, Phi-3's fused checkpoint tensors) is a field here, so the one Llama-style
module in ``llama.py`` covers Llama 2/3, SmolLM, Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3
(text), Phi-3/3.5 and the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss and
Llama 4 text (``moe``: a ``MoESpec``; gpt-oss adds attention sinks, Llama 4 chunked
attention, NoPE layers and q/k L2 norm), and DeepSeek-V2/V3 (``mla``: multi-head latent
attention, ``runtime/models/mla.py``; DeepSeekMoE routing in the ``MoESpec``).
``hf_config``, ``moe_config``, ``llama4_config`` and ``deepseek_config`` read each family's
config keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenwire.runtime.models.deepseek_config import DEEPSEEK_ARCHITECTURES, MLASpec
from tokenwire.runtime.models.hf_config import family_fields
from tokenwire.runtime.models.llama4_config import text_view
from tokenwire.runtime.models.moe_config import LLAMA4_ARCHITECTURES, MoESpec

# HF ``architectures`` names served by ``tokenwire.runtime.models.llama``.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    *LLAMA4_ARCHITECTURES,
    *DEEPSEEK_ARCHITECTURES,
)

# Fallback when a config has no ``architectures`` list (e.g. ``AutoConfig.for_model``).
_MODEL_TYPE_TO_ARCH: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "llama4": "Llama4ForConditionalGeneration",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

# The engine flag that sets the tensor-parallel size; split errors name it.
TP_FLAG = "--tensor-parallel-size"


@dataclass(frozen=True)
class ModelArch:
    """Shapes and flags of a decoder-only Llama-style model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Rope scaling as sorted (key, value) items, hashable; None for plain rope.
    # Always contains "rope_type" when set. Use ``rope_scaling_dict()`` to read it.
    rope_scaling: tuple[tuple[str, Any], ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always)
    o_proj_bias: bool  # bias on the attention output projection (Llama attention_bias)
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3, Gemma 3)
    # The largest attention window of any layer when the model uses sliding-window attention,
    # else None. Full attention equals sliding-window attention while max_model_len <= it.
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"  # the MLP gate's activation (kernels.activation.gated_activation)
    # Gemma: norm weights are offsets (scale 1 + w, applied in float32).
    norm_unit_offset: bool = False
    # Gemma 2/3: norms after attention and around the MLP too (4 per layer).
    sandwich_norms: bool = False
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden), in the model dtype
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_logit_softcap: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2/3: the same on the output logits
    # Per layer: its attention window (None: full attention); empty means ``sliding_window``
    # for every layer.
    layer_sliding_window: tuple[int | None, ...] = ()
    # Gemma 3: rope base of the sliding-window layers (plain rope); global layers use
    # rope_theta + rope_scaling. None: one rope for every layer.
    sliding_rope_theta: float | None = None
    # Phi-3: the checkpoint stores qkv_proj and gate_up_proj fused (split at load time).
    fused_checkpoint_projections: bool = False
    # Mixtral / Qwen MoE: the sparse MLP and which layers use it (None: every MLP is dense,
    # ``intermediate_size`` wide).
    moe: MoESpec | None = None
    # gpt-oss: a learned per-head logit joins every attention softmax (``self_attn.sinks``).
    attention_sinks: bool = False
    # Llama 4: per layer, the chunk size of a chunked local-attention layer (the query at
    # ``p`` sees keys ``[p // C * C, p]``; None: not chunked); empty: no chunked layer.
    layer_attention_chunk: tuple[int | None, ...] = ()
    # Llama 4: per layer, whether q/k are rotated (False: a NoPE layer); empty: every layer.
    layer_rope: tuple[bool, ...] = ()
    # Llama 4: a weightless RMS norm of q and k after rotary, on rope layers.
    qk_l2_norm: bool = False
    # Llama 4: (floor_scale, attn_scale) of the attention temperature tuning of NoPE layers.
    attn_temperature: tuple[float, float] | None = None
    # Llama 4: the checkpoint's q/k rows rotate interleaved pairs (permuted at load time).
    interleaved_rope_checkpoint: bool = False
    # DeepSeek-V2/V3: multi-head latent attention. The cache then holds one latent "head" per
    # token (``head_dim`` = kv_lora_rank + qk_rope_head_dim, one KV head, no separate V).
    mla: MLASpec | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """Features rotated per head: ``head_dim``, or MLA's ``qk_rope_head_dim``."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def kv_cache_parts(self) -> int:
        """Cache tensors per layer: K and V (2), or MLA's one latent cache (1)."""
        return 2 if self.mla is None else 1

    @property
    def attention_scale(self) -> float:
        """The factor on q.k (before any soft-cap)."""
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window in tokens; None: full attention."""
        if not self.layer_sliding_window:
            return self.sliding_window
        return self.layer_sliding_window[layer]

    def layer_chunk(self, layer: int) -> int | None:
        """Layer ``layer``'s attention chunk size (Llama 4); None: not chunked."""
        return self.layer_attention_chunk[layer] if self.layer_attention_chunk else None

    def layer_uses_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates q/k (False: a Llama 4 NoPE layer)."""
        return self.layer_rope[layer] if self.layer_rope else True

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts (else dense)."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    def layer_uses_local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates with ``sliding_rope_theta`` (Gemma 3's local layers)."""
        return self.sliding_rope_theta is not None and self.layer_window(layer) is not None

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise ``ValueError`` (naming ``--tensor-parallel-size``) unless this model splits
        over ``tp_size`` ranks: attention heads and the MLP intermediate size must divide
        evenly; KV heads must either divide evenly or be replicated (``tp_size`` a multiple of
        the KV head count). The vocabulary always splits: it is padded to a multiple of
        ``tp_size``. MoE: each expert's (and the shared expert's) intermediate size splits
        too; ``intermediate_size`` only when some layer is dense."""
        split_heads(self.num_attention_heads, self.num_key_value_heads, 0, tp_size)
        llama4 = self.architecture in LLAMA4_ARCHITECTURES  # dense width: intermediate_size_mlp
        sizes = {"intermediate_size_mlp" if llama4 else "intermediate_size": self.intermediate_size}
        if self.moe is not None:
            if all(self.moe.sparse_layers):
                sizes = {}
            # Mixtral's and gpt-oss's experts' width key
            mixtral = self.architecture in ("MixtralForCausalLM", "GptOssForCausalLM")
            mixtral = mixtral or llama4
            key = "intermediate_size" if mixtral else "moe_intermediate_size"
            sizes[key] = self.moe.intermediate_size
            if self.moe.has_shared_expert and not llama4:  # Llama 4: intermediate_size
                sizes["shared_expert_intermediate_size"] = self.moe.shared_expert_intermediate_size
        for key, size in sizes.items():
            if size % tp_size:
                raise ValueError(
                    f"{TP_FLAG}={tp_size} does not divide the model's {key} ({size}): "
                    "choose a tensor-parallel size that divides it"
                )

    def num_local_kv_heads(self, tp_size: int = 1) -> int:
        """KV heads each rank holds (and caches) under ``tp_size``-way tensor parallelism."""
        return split_heads(
            self.num_attention_heads, self.num_key_value_heads, 0, tp_size
        ).num_kv_heads

    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        """Build from a ``transformers.PretrainedConfig`` or a parsed config.json dict."""
        cfg: Mapping[str, Any] = config if isinstance(config, Mapping) else config.to_dict()
        cfg = text_view(cfg)
        architecture = _architecture(cfg)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        fields = family_fields(cfg, architecture)
        return cls(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(fields.pop("intermediate_size", cfg["intermediate_size"])),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(
                fields.pop("num_key_value_heads", None) or cfg.get("num_key_value_heads") or heads
            ),
            head_dim=int(fields.pop("head_dim", None) or cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            bos_token_id=_optional_int(cfg.get("bos_token_id")),
            eos_token_ids=token_id_tuple(cfg.get("eos_token_id")),
            **fields,
        )


@dataclass(frozen=True)
class HeadSplit:
    """One rank's attention heads: query heads ``[head_start, head_start + num_heads)`` and KV
    heads ``[kv_head_start, kv_head_start + num_kv_heads)`` of the full model."""

    num_heads: int
    num_kv_heads: int
    head_start: int
    kv_head_start: int


def split_heads(num_heads: int, num_kv_heads: int, rank: int, tp_size: int) -> HeadSplit:
    """Split attention heads over ``tp_size`` ranks (vLLM's rule).

    Query heads split evenly. KV heads split evenly when ``num_kv_heads >= tp_size``;
    otherwise each KV head is replicated on ``tp_size // num_kv_heads`` consecutive ranks
    (rank r holds KV head ``r // (tp_size // num_kv_heads)``), which needs ``tp_size`` to be a
    multiple of ``num_kv_heads``. Either way every rank keeps whole GQA groups: its query heads
    attend only to the KV heads it holds. Errors name ``--tensor-parallel-size``.
    """
    if tp_size < 1:
        raise ValueError(f"{TP_FLAG} must be >= 1, got {tp_size}")
    if num_heads % tp_size:
        raise ValueError(
            f"{TP_FLAG}={tp_size} does not divide the model's {num_heads} attention heads: "
            f"choose a tensor-parallel size that divides {num_heads}"
        )
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"{TP_FLAG}={tp_size} does not divide the model's {num_kv_heads} KV heads "
                f"(and is smaller, so they cannot be replicated): choose a tensor-parallel "
                f"size that divides {num_kv_heads} or is a multiple of it"
            )
        local_kv = num_kv_heads // tp_size
        kv_start = rank * local_kv
    else:
        if tp_size % num_kv_heads:
            raise ValueError(
                f"{TP_FLAG}={tp_size} is neither a divisor nor a multiple of the model's "
                f"{num_kv_heads} KV heads, so they can be neither split nor replicated: "
                f"choose a tensor-parallel size that is a multiple of {num_kv_heads}"
            )
        local_kv = 1
        kv_start = rank // (tp_size // num_kv_heads)
    local_heads = num_heads // tp_size
    return HeadSplit(local_heads, local_kv, rank * local_heads, kv_start)


def token_id_tuple(value: Any) -> tuple[int, ...]:
    """Normalise an HF ``eos_token_id`` field (None, int or list of ints) to a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _architecture(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    name = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(str(cfg.get("model_type")), "")
    if name not in SUPPORTED_ARCHITECTURES:
        shown = name or f"model_type={cfg.get('model_type')!r}"
        raise ValueError(
            f"unsupported model architecture {shown}; supported architectures: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    return name
