"""DeepSeek-V2/V3 checkpoint tensors -> the names (and layouts) the usual loader expects.

- ``self_attn.q_proj`` (no ``q_lora_rank``) becomes ``self_attn.q_head_proj`` (``loading``
  fuses any ``q_proj`` into ``qkv_proj``).
- The rope rows rotate interleaved pairs ``(2i, 2i + 1)`` (V2 always, V3 with
  ``rope_interleave``); ``kernels.rotary`` rotates ``(i, i + R/2)``. The last
  ``qk_rope_head_dim`` rows of each head of ``q_proj``/``q_b_proj`` and of
  ``kv_a_proj_with_mqa`` are permuted to ``[0, 2, 4, ..., 1, 3, 5, ...]``: q and k are
  permuted alike, so their dot product is unchanged.
- ``mlp.shared_experts`` -> ``mlp.shared_expert``; ``mlp.gate.e_score_correction_bias`` ->
  ``mlp.e_score_correction_bias``; HF's fused experts (``mlp.experts.gate_up_proj``
  ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) -> per-expert tensors.
- Layers past ``num_hidden_layers`` (V3's multi-token-prediction layer) are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.weights import WeightSource, as_weight_source

_Weights = Iterable[tuple[str, torch.Tensor | WeightSource]]
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def deepseek_tensors(
    weights: _Weights, arch: ModelArch
) -> Iterator[tuple[str, torch.Tensor | WeightSource]]:
    """Yield ``weights`` renamed, split and permuted as the module doc says."""
    mla = arch.mla
    assert mla is not None, "deepseek_tensors needs an MLA architecture"
    for name, weight in weights:
        layer = _LAYER.match(name)
        if layer is not None and int(layer.group(1)) >= arch.num_hidden_layers:
            continue
        name = name.replace(".self_attn.q_proj.", ".self_attn.q_head_proj.")
        name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
        name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
        interleaved = mla.interleaved_rope
        if interleaved and name.endswith((".q_head_proj.weight", ".q_b_proj.weight")):
            heads = arch.num_attention_heads
            yield name, rope_rows_half_split(weight, heads, mla.qk_head_dim, mla.qk_rope_head_dim)
        elif interleaved and name.endswith(".kv_a_proj_with_mqa.weight"):
            yield name, rope_rows_half_split(weight, 1, mla.latent_dim, mla.qk_rope_head_dim)
        elif name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            yield from _expert_tensors(name, as_weight_source(weight).read())
        else:
            yield name, weight


def rope_rows_half_split(
    weight: torch.Tensor | WeightSource, groups: int, group_rows: int, rope: int
) -> torch.Tensor:
    """Each of ``groups`` blocks of ``group_rows`` rows: its last ``rope`` rows from
    interleaved pairs to the half-split layout."""
    tensor = as_weight_source(weight).read()
    blocks = tensor.reshape(groups, group_rows, *tensor.shape[1:]).clone()
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]) + group_rows - rope
    blocks[:, group_rows - rope :] = blocks[:, order]
    return blocks.reshape(tensor.shape).contiguous()


def _expert_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """HF's fused [E, 2I, H] gate/up (gate rows first) and [E, H, I] down -> per expert."""
    prefix, _, kind = name.rpartition(".")
    for e in range(tensor.shape[0]):
        if kind == "gate_up_proj":
            gate, up = tensor[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate.contiguous()
            yield f"{prefix}.{e}.up_proj.weight", up.contiguous()
        else:
            yield f"{prefix}.{e}.down_proj.weight", tensor[e].contiguous()
