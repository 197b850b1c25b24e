"""Checkpoint -> (fused, per-rank, possibly quantized) parameters, and dummy weights.

The model says how each of its parameters is cut from checkpoint tensors (``shard_loads``:
parameter -> shard id -> ``ShardLoad``); these functions walk a checkpoint's HF-named tensors
through that map. HF's separate ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``
tensors (any suffix: ``weight``, ``bias``, GPTQ/AWQ ``qweight``/``qzeros``/``scales``/``g_idx``)
land in the fused ``qkv_proj`` / ``gate_up_proj`` parameters. MoE experts' tensors (Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen's ``mlp.experts.{e}.gate_proj/up_proj/down_proj``)
land in expert ``e`` of the stacked ``mlp.experts.w13_weight`` / ``w2_weight`` (shard ids
``"{e}.gate"``, ``"{e}.up"``, ``"{e}.down"``). Errors name the checkpoint tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch import nn

from tokenwire.runtime.models.layers.quant.base import LinearLayer, ParamLayout, fill_dummy
from tokenwire.runtime.models.weights import (
    ShardLoad,
    WeightSource,
    as_weight_source,
    fill_sharded,
    load_shard,
)

ShardLoadMap = dict[str, dict[str, ShardLoad]]

# HF checkpoint projection -> (fused parameter, shard id). Shard order inside the fused
# tensor is q, k, v and gate, up (silu_and_mul expects gate first).
STACKED_PARAMS: tuple[tuple[str, str, str], ...] = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", "gate"),
    ("up_proj", "gate_up_proj", "up"),
)

# One routed expert's projection (unquantized): prefix, expert index, projection.
_EXPERT = re.compile(
    r"^(.*)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|bias)$"
)
# Checkpoint projection -> (stacked experts parameter, part of the shard id).
_EXPERT_PARTS: dict[str, tuple[str, str]] = {
    "w1": ("w13_weight", "gate"),
    "gate_proj": ("w13_weight", "gate"),
    "w3": ("w13_weight", "up"),
    "up_proj": ("w13_weight", "up"),
    "w2": ("w2_weight", "down"),
    "down_proj": ("w2_weight", "down"),
}
_STACKED_EXPERTS = re.compile(r"^(.*)\.experts\.(w13|w2)_(weight|bias)$")


def map_name(hf_name: str) -> tuple[str, str]:
    """HF parameter name -> (our parameter name, shard id; "" when not fused)."""
    hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's MoE block
    expert = _EXPERT.match(hf_name)
    if expert is not None:
        prefix, index, projection, kind = expert.groups()
        param, part = _EXPERT_PARTS[projection]
        if kind == "bias":  # gpt-oss: w13_bias / w2_bias
            param = param.replace("_weight", "_bias")
        return f"{prefix}.experts.{param}", f"{index}.{part}"
    for src, dst, shard in STACKED_PARAMS:
        if f".{src}." in hf_name:
            return hf_name.replace(f".{src}.", f".{dst}."), shard
    return hf_name, ""


def checkpoint_name(name: str, shard: str) -> str:
    """The checkpoint tensor a (fused) parameter's shard comes from, for error messages."""
    experts = _STACKED_EXPERTS.match(name)
    if experts is not None and "." in shard:
        index, part = shard.split(".")
        mixtral = {"gate": "w1", "up": "w3", "down": "w2"}[part]
        where = f"{experts.group(1)}.experts.{index}.{part}_proj (Mixtral: {mixtral})"
        return f"{where}.{experts.group(3)} ({name}[{shard}])"
    for src, dst, stacked in STACKED_PARAMS:
        if shard == stacked and f".{dst}." in name:
            return f"{name.replace(f'.{dst}.', f'.{src}.')} ({name}[{shard}])"
    return name


@torch.no_grad()
def load_checkpoint(
    model: nn.Module,
    loads: ShardLoadMap,
    weights: Iterable[tuple[str, torch.Tensor | WeightSource]],
    skip: Callable[[str], bool],
    architecture: str,
    *,
    zero_biases_ok: bool = False,
) -> None:
    """Copy every tensor of ``weights`` (not ``skip``-ped) into ``model``'s parameters.

    A ``shared`` tensor (GPTQ ``g_idx`` of q, k and v) is copied once and compared after.
    ``zero_biases_ok``: an all-zero ``*.bias`` the model has no parameter for is ignored
    (AutoGPTQ gives every quantized linear a bias, zero where the model had none; vLLM skips
    them too). Raises ValueError naming the checkpoint tensor on an unknown name, a shape or
    dtype mismatch, or a tensor (or fused shard) the checkpoint never provided; optional
    tensors it left out are emptied.
    """
    params = dict(model.named_parameters())
    loaded: dict[str, set[str]] = {name: set() for name in params}
    for hf_name, weight in weights:
        if skip(hf_name):
            continue
        name, shard = map_name(hf_name)
        spec = loads.get(name, {}).get(shard)
        if name not in params or spec is None:
            if zero_biases_ok and _zero_bias(hf_name, weight):
                continue
            raise ValueError(f"unexpected weight {hf_name!r} for {architecture}")
        compare = spec.shared and bool(loaded[name])
        load_shard(params[name], spec, as_weight_source(weight), hf_name, compare=compare)
        loaded[name].add(shard)
    _check_complete(model, loads, loaded)


def _zero_bias(hf_name: str, weight: torch.Tensor | WeightSource) -> bool:
    if not hf_name.endswith(".bias"):
        return False
    return not bool(as_weight_source(weight).read().any())


def _check_complete(model: nn.Module, loads: ShardLoadMap, loaded: dict[str, set[str]]) -> None:
    optional = optional_params(model)
    missing: list[str] = []
    for name, shards in loaded.items():
        wanted = set(loads[name])
        if name in optional and not shards:
            optional[name].empty(name.rpartition(".")[2])
        elif shards != wanted and not (shards and loads[name][min(shards)].shared):
            missing.extend(checkpoint_name(name, shard) for shard in sorted(wanted - shards))
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(sorted(missing))}")


def param_layouts(model: nn.Module) -> dict[str, ParamLayout]:
    """Full parameter name -> layout, for every linear layer's parameters."""
    return {
        f"{prefix}.{local}": layout
        for prefix, module in model.named_modules()
        if isinstance(module, LinearLayer)
        for local, layout in module.param_layouts.items()
    }


def optional_params(model: nn.Module) -> dict[str, LinearLayer]:
    """Full name -> layer of every parameter a checkpoint may omit (GPTQ ``g_idx`` without
    act order)."""
    found: dict[str, LinearLayer] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, LinearLayer):
            for local, layout in module.param_layouts.items():
                if layout.optional:
                    found[f"{prefix}.{local}"] = module
    return found


@torch.no_grad()
def init_random(
    model: nn.Module, loads: ShardLoadMap, generator: torch.Generator, std: float
) -> None:
    """Dummy weights, parameter by parameter in registration order: norm weights 1, the
    rest by ``fill_dummy`` (N(0, std); random codes and constant scales for quantized
    tensors). ``loads`` empty: each parameter is drawn in place (TP=1); else each rank draws
    the full (TP=1) tensor and keeps its slices (``fill_sharded``)."""
    layouts = param_layouts(model)
    for name, param in model.named_parameters():
        layout = layouts.get(name)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif not loads:
            fill_dummy(param, layout, generator, std)
        else:
            fill = partial(fill_dummy, layout=layout, generator=generator, std=std)
            fill_sharded(param, name, loads[name], fill)
    for name, layer in optional_params(model).items():
        if layouts[name].dummy == "skip":
            layer.empty(name.rpartition(".")[2])
