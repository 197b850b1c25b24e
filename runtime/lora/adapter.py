"""A PEFT LoRA adapter directory checked against the served model, and its tensors read.

A PEFT adapter is ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) plus ``adapter_model.safetensors`` with, per targeted projection,
``...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r].
``y = base(x) + scaling * (x @ A.T) @ B.T`` with ``scaling = lora_alpha / r`` (rsLoRA:
``lora_alpha / sqrt(r)``).

``inspect_adapter`` reads only the config and the safetensors header (no tensor data, through
the bounded readers of ``checks`` / ``files``) and checks them against the model: the engine
core calls it before it accepts an adapter, so a bad one is refused with an ``AdapterError``
naming what is wrong while the engine serves on. ``load_adapter`` reads the tensors (a
worker, the first time a request uses the adapter).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tokenwire.runtime.errors import AdapterError
from tokenwire.runtime.lora.checks import TARGET_MODULES, read_adapter
from tokenwire.runtime.lora.request import CONFIG_FILE, WEIGHTS_FILE
from tokenwire.runtime.models.arch import ModelArch

__all__ = [
    "CONFIG_FILE",
    "TARGET_MODULES",
    "WEIGHTS_FILE",
    "AdapterSpec",
    "AdapterWeights",
    "inspect_adapter",
    "load_adapter",
    "projection_shape",
]


def projection_shape(arch: ModelArch, module: str) -> tuple[int, int]:
    """(out_features, in_features) of one projection of the full (unsplit) model."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (arch.q_size, hidden),
        "k_proj": (arch.kv_size, hidden),
        "v_proj": (arch.kv_size, hidden),
        "o_proj": (hidden, arch.q_size),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }[module]


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter directory holds, checked against the model (no tensor data)."""

    path: str
    rank: int
    scaling: float
    # (layer index, module name) -> safetensors keys of its A and B.
    keys: dict[tuple[int, str], tuple[str, str]]

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.keys)


@dataclass(frozen=True)
class AdapterWeights:
    """A loaded adapter: per (layer, module), A [r, in] and B [out, r] (scaling folded into
    B), full (unsplit) tensors on the CPU in float32."""

    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def inspect_adapter(path: str, arch: ModelArch, max_rank: int) -> AdapterSpec:
    """Check a PEFT adapter directory against ``arch``; ``AdapterError`` names what is wrong."""
    files = read_adapter(path, max_rank)
    rank = files.rank
    for (layer, module), (key_a, key_b) in files.keys.items():
        if layer >= arch.num_hidden_layers:
            raise AdapterError(
                WEIGHTS_FILE,
                f"layer {layer} does not exist (the model has {arch.num_hidden_layers})",
            )
        out_f, in_f = projection_shape(arch, module)
        for which, key, want in (("A", key_a, (rank, in_f)), ("B", key_b, (out_f, rank))):
            got = files.tensors[key].shape
            if got != want:
                raise AdapterError(
                    WEIGHTS_FILE,
                    f"layer {layer} {module} lora_{which} has shape {list(got)}, the model "
                    f"needs {list(want)} (rank {rank})",
                )
    return AdapterSpec(str(Path(path)), rank, files.scaling, dict(files.keys))


def load_adapter(spec: AdapterSpec) -> AdapterWeights:
    """Read the tensors of a checked adapter (float32, scaling folded into B)."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    with safe_open(str(Path(spec.path) / WEIGHTS_FILE), framework="pt") as f:
        for target, (key_a, key_b) in spec.keys.items():
            a = f.get_tensor(key_a).float()
            b = f.get_tensor(key_b).float() * spec.scaling
            weights[target] = (a, b)
    return AdapterWeights(spec.rank, weights)
