"""gpt-oss checkpoint tensors -> the per-expert HF names the usual loader stacks.

HF's ``GptOssForCausalLM`` stores each layer's experts fused and transposed:
``mlp.experts.gate_up_proj`` ``[E, H, 2 * I]`` with gate and up *interleaved* along the last
dimension (``gate = [..., ::2]``, ``up = [..., 1::2]``), ``gate_up_proj_bias`` ``[E, 2 * I]``
(interleaved the same way), ``down_proj`` ``[E, I, H]`` and ``down_proj_bias`` ``[E, H]``; the
router is ``mlp.router.weight`` / ``bias``. ``split_gpt_oss_experts`` yields them as
``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight|bias`` (``[out, in]`` like every other
linear) and ``mlp.gate.weight|bias``, which ``loading.map_name`` maps into the stacked
``w13``/``w2`` parameters.

The published checkpoints store the two expert matrices in MXFP4 (``runtime/models/mxfp4.py``)
instead: ``gate_up_proj_blocks`` ``[E, 2 * I, H / 32, 16]`` with ``gate_up_proj_scales``
``[E, 2 * I, H / 32]`` (rows are the output features, gate/up interleaved) and
``down_proj_blocks`` ``[E, H, I / 32, 16]`` with ``down_proj_scales``; the biases stay bf16.
Each pair is read whole once both halves have been seen (in any order, in any file of the
checkpoint), then de-quantized exactly (float32) one expert at a time and yielded under the
same per-expert names; tensor parallelism then takes each rank's slice of those like any
unquantized expert (the shards are cut after de-quantizing). A ``*_blocks`` without its
``*_scales`` (or the other way round) is a load error naming the tensor. Where the model
keeps them quantized (CUDA / the Triton interpreter: ``gpt_oss_mxfp4``) the four tensors pass
through unread, renamed to ``mlp.experts.mxfp4.*``, and each rank reads only its slice.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenwire.runtime.models.gpt_oss_mxfp4 import MXFP4_TENSORS, MXFP4Experts
from tokenwire.runtime.models.mxfp4 import check_mxfp4_pair, dequantize_mxfp4
from tokenwire.runtime.models.weights import WeightSource, as_weight_source

_MXFP4_SUFFIXES = ("_blocks", "_scales")
_MXFP4_KINDS = ("gate_up_proj", "down_proj")


def split_gpt_oss_experts(
    weights: Iterable[tuple[str, torch.Tensor | WeightSource]], model: nn.Module | None = None
) -> Iterator[tuple[str, torch.Tensor | WeightSource]]:
    """Yield ``weights`` with gpt-oss's router and fused expert tensors renamed and split per
    expert, MXFP4 expert pairs de-quantized (see the module doc); every other tensor passes
    through unchanged. When ``model`` keeps its experts in MXFP4 (``gpt_oss_mxfp4``), the
    MXFP4 tensors pass through unread instead, renamed into its ``experts.mxfp4`` holders."""
    keep = model is not None and any(isinstance(m, MXFP4Experts) for m in model.modules())
    pending: dict[str, torch.Tensor] = {}  # MXFP4 halves waiting for their partner, by name
    for name, weight in weights:
        prefix, sep, leaf = name.rpartition(".mlp.")
        if not sep:
            yield name, weight
        elif leaf in ("router.weight", "router.bias"):
            yield f"{prefix}.mlp.gate.{leaf.rpartition('.')[2]}", weight
        elif keep and leaf.removeprefix("experts.") in MXFP4_TENSORS:
            yield f"{prefix}.mlp.experts.mxfp4.{leaf.removeprefix('experts.')}", weight
        elif leaf.startswith("experts.") and leaf.endswith(_MXFP4_SUFFIXES):
            pending[name] = as_weight_source(weight).read()
            yield from _complete_mxfp4_pair(name, pending)
        elif leaf.startswith("experts."):
            tensor = as_weight_source(weight).read()
            yield from _expert_tensors(f"{prefix}.mlp.experts", leaf[len("experts.") :], tensor)
        else:
            yield name, weight
    for name in sorted(pending):
        base = name[: -len("_blocks")]  # both suffixes have the same length
        missing = base + ("_scales" if name.endswith("_blocks") else "_blocks")
        raise ValueError(f"MXFP4 tensor {name!r} has no {missing!r} in the checkpoint")


def _complete_mxfp4_pair(
    name: str, pending: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Once both ``<base>_blocks`` and ``<base>_scales`` are in ``pending``, take them out and
    yield the de-quantized per-expert tensors; otherwise nothing (yet)."""
    base = name[: -len("_blocks")]
    blocks_name, scales_name = base + "_blocks", base + "_scales"
    if blocks_name not in pending or scales_name not in pending:
        return
    blocks, scales = pending.pop(blocks_name), pending.pop(scales_name)
    prefix, _, kind = base.rpartition(".")  # "<layer>.mlp.experts", "gate_up_proj"
    if kind not in _MXFP4_KINDS:
        raise ValueError(f"unexpected weight {blocks_name!r} for GptOssForCausalLM")
    check_mxfp4_pair(blocks_name, blocks, scales_name, scales)
    if blocks.dim() != 4:
        raise ValueError(
            f"MXFP4 tensor {blocks_name!r} has shape {tuple(blocks.shape)}: expected "
            "[experts, out_features, in_features / 32, 16]"
        )
    for e in range(blocks.shape[0]):
        weight = dequantize_mxfp4(blocks[e], scales[e], blocks_name)  # [out, in]
        if kind == "gate_up_proj":  # rows interleaved: gate, up, gate, up, ...
            if weight.shape[0] % 2:
                raise ValueError(
                    f"MXFP4 tensor {blocks_name!r} has {weight.shape[0]} rows: gate and up "
                    "rows interleave, so the count must be even"
                )
            yield f"{prefix}.{e}.gate_proj.weight", weight[::2]
            yield f"{prefix}.{e}.up_proj.weight", weight[1::2]
        else:
            yield f"{prefix}.{e}.down_proj.weight", weight


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
