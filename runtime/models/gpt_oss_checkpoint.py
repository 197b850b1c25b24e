"""gpt-oss checkpoint tensors -> the per-expert HF names the usual loader stacks.

HF's ``GptOssForCausalLM`` stores each layer's experts fused and transposed:
``mlp.experts.gate_up_proj`` ``[E, H, 2 * I]`` with gate and up *interleaved* along the last
dimension (``gate = [..., ::2]``, ``up = [..., 1::2]``), ``gate_up_proj_bias`` ``[E, 2 * I]``
(interleaved the same way), ``down_proj`` ``[E, I, H]`` and ``down_proj_bias`` ``[E, H]``; the
router is ``mlp.router.weight`` / ``bias``. ``split_gpt_oss_experts`` yields them as
``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight|bias`` (``[out, in]`` like every other
linear) and ``mlp.gate.weight|bias``, which ``loading.map_name`` maps into the stacked
``w13``/``w2`` parameters. MXFP4-quantized experts (``*_blocks`` / ``*_scales``) are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tokenwire.runtime.models.weights import WeightSource, as_weight_source

_MXFP4_SUFFIXES = ("_blocks", "_scales")


def split_gpt_oss_experts(
    weights: Iterable[tuple[str, torch.Tensor | WeightSource]],
) -> Iterator[tuple[str, torch.Tensor | WeightSource]]:
    """Yield ``weights`` with gpt-oss's router and fused expert tensors renamed and split per
    expert (see the module doc); every other tensor passes through unchanged."""
    for name, weight in weights:
        prefix, sep, leaf = name.rpartition(".mlp.")
        if not sep:
            yield name, weight
        elif leaf in ("router.weight", "router.bias"):
            yield f"{prefix}.mlp.gate.{leaf.rpartition('.')[2]}", weight
        elif leaf.startswith("experts.") and leaf.endswith(_MXFP4_SUFFIXES):
            raise ValueError(
                f"checkpoint tensor {name!r} is MXFP4-quantized: tokenwire loads gpt-oss "
                "checkpoints with unquantized (bf16/float32) experts only"
            )
        elif leaf.startswith("experts."):
            tensor = as_weight_source(weight).read()
            yield from _expert_tensors(f"{prefix}.mlp.experts", leaf[len("experts.") :], tensor)
        else:
            yield name, weight


def _expert_tensors(
    prefix: str, kind: str, tensor: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """One fused expert tensor ``kind`` [E, ...] -> per-expert ``[out, in]`` tensors."""
    if kind not in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        raise ValueError(f"unexpected weight '{prefix}.{kind}' for GptOssForCausalLM")
    for e in range(tensor.shape[0]):
        t = tensor[e]
        if kind == "gate_up_proj":  # [H, 2I], interleaved columns
            yield f"{prefix}.{e}.gate_proj.weight", t[:, ::2].t()
            yield f"{prefix}.{e}.up_proj.weight", t[:, 1::2].t()
        elif kind == "gate_up_proj_bias":  # [2I], interleaved
            yield f"{prefix}.{e}.gate_proj.bias", t[::2]
            yield f"{prefix}.{e}.up_proj.bias", t[1::2]
        elif kind == "down_proj":  # [I, H]
            yield f"{prefix}.{e}.down_proj.weight", t.t()
        else:
            yield f"{prefix}.{e}.down_proj.bias", t
