"""Llama 4 checkpoint tensors -> the names (and layouts) the usual loader expects.

HF's ``Llama4ForCausalLM`` calls each layer's MLP ``feed_forward``: a dense layer's
``gate_proj``/``up_proj``/``down_proj``, or a MoE layer's ``router.weight`` ``[E, H]``,
``shared_expert.*`` and the fused experts ``experts.gate_up_proj`` ``[E, H, 2 * I]`` (gate
columns, then up columns) and ``experts.down_proj`` ``[E, I, H]``. ``llama4_tensors`` yields
them as ``mlp.*``, ``mlp.gate.weight`` and per-expert ``mlp.experts.{e}.gate_proj/up_proj/
down_proj.weight`` (``[out, in]``), which ``loading.map_name`` stacks.

HF rotates q/k as complex numbers over interleaved pairs ``(2i, 2i + 1)``; ``kernels.rotary``
rotates the pairs ``(i, i + D/2)``. Each head's rows of ``q_proj``/``k_proj`` (weight and
bias) are permuted to ``[0, 2, 4, ..., 1, 3, 5, ...]`` so both rotate the same pairs with
the same frequencies; q.k is unchanged by the common permutation, and so are the L2 norm
and the temperature.

``Llama4ForConditionalGeneration`` stores the text model under ``language_model.``; its
``vision_model.*`` and ``multi_modal_projector.*`` tensors are skipped (text only).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.weights import WeightSource, as_weight_source

_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")
_Weights = Iterable[tuple[str, torch.Tensor | WeightSource]]


def llama4_tensors(
    weights: _Weights, arch: ModelArch
) -> Iterator[tuple[str, torch.Tensor | WeightSource]]:
    """Yield ``weights`` renamed, split and permuted as the module doc says."""
    for name, weight in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        name = name.removeprefix("language_model.")
        name = name.replace(".feed_forward.", ".mlp.")
        if ".self_attn.q_proj." in name:
            yield name, _half_split_rows(weight, arch.num_attention_heads, arch.head_dim)
        elif ".self_attn.k_proj." in name:
            yield name, _half_split_rows(weight, arch.num_key_value_heads, arch.head_dim)
        elif name.endswith(".mlp.router.weight"):
            yield name.replace(".mlp.router.", ".mlp.gate."), weight
        elif name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            yield from _expert_tensors(name, as_weight_source(weight).read())
        else:
            yield name, weight


def _half_split_rows(
    weight: torch.Tensor | WeightSource, num_heads: int, head_dim: int
) -> torch.Tensor:
    """q/k rows (or bias) per head from interleaved pairs to the half-split layout."""
    tensor = as_weight_source(weight).read()
    rest = tensor.shape[1:]
    per_head = tensor.reshape(num_heads, head_dim // 2, 2, *rest)
    return per_head.transpose(1, 2).reshape(num_heads * head_dim, *rest).contiguous()


def _expert_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A fused expert tensor [E, ...] -> per-expert ``[out, in]`` tensors."""
    prefix, _, kind = name.rpartition(".")
    for e in range(tensor.shape[0]):
        t = tensor[e]
        if kind == "gate_up_proj":  # [H, 2I]: gate columns, then up columns
            gate, up = t.chunk(2, dim=-1)
            yield f"{prefix}.{e}.gate_proj.weight", gate.t().contiguous()
            yield f"{prefix}.{e}.up_proj.weight", up.t().contiguous()
        else:  # down_proj [I, H]
            yield f"{prefix}.{e}.down_proj.weight", t.t().contiguous()
