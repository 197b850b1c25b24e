"""Per GGUF architecture: llama.cpp's block tensor names -> HF parameter names, and how the
converter changed the values (``convert_hf_to_gguf.py``).

- ``llama`` permutes the q/k rows (``names.hf_row_order`` undoes it); ``qwen2``, ``qwen3``,
  ``qwen3moe``, ``gemma2``, ``gemma3`` and ``phi3`` use NeoX rope: rows as in HF.
- ``gemma2`` / ``gemma3`` store every RMSNorm weight as ``1 + w`` (HF's Gemma norm multiplies
  by ``1 + w``; llama.cpp's by the stored weight): ``norm_offset`` is subtracted back. Their
  four norms per block: ``attn_norm`` (input), ``post_attention_norm``, ``ffn_norm``
  (pre-feedforward) and ``post_ffw_norm``.
- ``phi3`` keeps HF's fused ``qkv_proj`` (``attn_qkv``: q rows, then k, then v) and
  ``gate_up_proj`` (``ffn_up``: gate rows, then up): ``fused``.
- ``qwen3moe`` stacks each layer's experts on a leading axis (``ffn_gate_exps`` [E, I, H],
  ``ffn_up_exps``, ``ffn_down_exps`` [E, H, I]); ``ffn_gate_inp`` is the router: ``experts``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


def _frozen(table: Mapping[str, str] | None = None, **extra: str) -> Mapping[str, str]:
    return MappingProxyType({**(table or {}), **extra})


@dataclass(frozen=True)
class Family:
    block: Mapping[str, str]  # GGUF block part -> HF module path (one parameter)
    permuted_qk: bool = False  # llama.cpp permuted the q/k rows
    norm_offset: float = 0.0  # the converter added this to every norm weight
    # GGUF block part -> HF module paths whose rows it stacks (storage order).
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    # GGUF block part -> HF projection of each expert (``mlp.experts.{e}.<projection>``).
    experts: Mapping[str, str] = field(default_factory=_frozen)


GLOBAL: Mapping[str, str] = _frozen(
    token_embd="model.embed_tokens", output_norm="model.norm", output="lm_head"
)
_ATTENTION = _frozen(
    attn_norm="input_layernorm",
    attn_q="self_attn.q_proj",
    attn_k="self_attn.k_proj",
    attn_v="self_attn.v_proj",
    attn_output="self_attn.o_proj",
)
_QK_NORM = _frozen(attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
_MLP = _frozen(ffn_gate="mlp.gate_proj", ffn_up="mlp.up_proj", ffn_down="mlp.down_proj")
# q/k norms named for every Llama-shaped family (as before): the model rejects what it lacks.
_LLAMA = _frozen({**_ATTENTION, **_QK_NORM, **_MLP}, ffn_norm="post_attention_layernorm")
_GEMMA2 = _frozen(
    {**_ATTENTION, **_MLP},
    post_attention_norm="post_attention_layernorm",
    ffn_norm="pre_feedforward_layernorm",
    post_ffw_norm="post_feedforward_layernorm",
)

FAMILIES: Mapping[str, Family] = MappingProxyType(
    {
        "llama": Family(_LLAMA, permuted_qk=True),
        "qwen2": Family(_LLAMA),
        "qwen3": Family(_LLAMA),
        "qwen3moe": Family(
            _frozen(
                {**_ATTENTION, **_QK_NORM},
                ffn_norm="post_attention_layernorm",
                ffn_gate_inp="mlp.gate",
            ),
            experts=_frozen(
                ffn_gate_exps="gate_proj", ffn_up_exps="up_proj", ffn_down_exps="down_proj"
            ),
        ),
        "gemma2": Family(_GEMMA2, norm_offset=1.0),
        "gemma3": Family(_frozen({**_GEMMA2, **_QK_NORM}), norm_offset=1.0),
        "phi3": Family(
            _frozen(
                attn_norm="input_layernorm",
                attn_output="self_attn.o_proj",
                ffn_norm="post_attention_layernorm",
                ffn_down="mlp.down_proj",
            ),
            fused=MappingProxyType(
                {
                    "attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    "ffn_up": ("mlp.gate_proj", "mlp.up_proj"),
                }
            ),
        ),
    }
)
