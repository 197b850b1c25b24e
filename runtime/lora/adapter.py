"""Reading a PEFT LoRA adapter directory and checking it against the served model.

A PEFT adapter is ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) plus ``adapter_model.safetensors`` with, per targeted projection,
``...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r].
``y = base(x) + scaling * (x @ A.T) @ B.T`` with ``scaling = lora_alpha / r`` (rsLoRA:
``lora_alpha / sqrt(r)``).

``inspect_adapter`` reads only the config and the safetensors header (no tensor data): the
engine core calls it before it accepts an adapter, so a bad one is refused with an
``AdapterError`` naming what is wrong while the engine serves on. ``load_adapter`` reads the
tensors (a worker, the first time a request uses the adapter).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tokenwire.runtime.errors import AdapterError
from tokenwire.runtime.models.arch import ModelArch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Projections LoRA can target (HF names), and which decoder block holds them.
TARGET_MODULES: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# Config keys whose non-default value changes the maths this engine implements.
_UNSUPPORTED: dict[str, Any] = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}


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


def _read_config(directory: Path) -> dict[str, Any]:
    config_path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise AdapterError("lora_path", "is not a directory")
    if not config_path.is_file():
        raise AdapterError("lora_path", f"has no {CONFIG_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(CONFIG_FILE, f"cannot be read as JSON ({type(exc).__name__})") from None
    if not isinstance(config, dict):
        raise AdapterError(CONFIG_FILE, "must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{CONFIG_FILE}:peft_type", f"must be LORA, got {peft_type!r}")
    for key, default in _UNSUPPORTED.items():
        value = config.get(key, default)
        if value not in (default, None, {}, False):
            raise AdapterError(f"{CONFIG_FILE}:{key}", "is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{CONFIG_FILE}:bias", "only 'none' is supported")
    return config


def _scaling(config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    rank = config.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"{CONFIG_FILE}:r", f"must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{CONFIG_FILE}:r", f"rank {rank} exceeds --max-lora-rank ({max_rank})")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{CONFIG_FILE}:lora_alpha", f"must be a number, got {alpha!r}")
    denom = math.sqrt(rank) if config.get("use_rslora", False) else rank
    return rank, float(alpha) / denom


def _check_targets(config: dict[str, Any]) -> None:
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(str(t) for t in targets if str(t).split(".")[-1] not in TARGET_MODULES)
        if unknown:
            raise AdapterError(
                f"{CONFIG_FILE}:target_modules",
                f"unsupported target module(s) {unknown}; supported: {sorted(TARGET_MODULES)}",
            )


def _match_keys(names: list[str], arch: ModelArch) -> dict[tuple[int, str], dict[str, str]]:
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name in names:
        m = _KEY.match(name)
        if m is None:
            raise AdapterError(WEIGHTS_FILE, f"unsupported LoRA tensor {name!r}")
        layer, block, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if TARGET_MODULES.get(module) != block:
            raise AdapterError(WEIGHTS_FILE, f"unsupported target module {block}.{module}")
        if layer >= arch.num_hidden_layers:
            raise AdapterError(
                WEIGHTS_FILE,
                f"layer {layer} does not exist (the model has {arch.num_hidden_layers})",
            )
        found.setdefault((layer, module), {})[which] = name
    return found


def inspect_adapter(path: str, arch: ModelArch, max_rank: int) -> AdapterSpec:
    """Check a PEFT adapter directory against ``arch``; ``AdapterError`` names what is wrong."""
    directory = Path(path)
    config = _read_config(directory)
    rank, scaling = _scaling(config, max_rank)
    _check_targets(config)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterError("lora_path", f"has no {WEIGHTS_FILE}")
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            names = list(f.keys())
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
    except Exception as exc:  # a truncated or foreign file
        raise AdapterError(WEIGHTS_FILE, f"cannot be read ({type(exc).__name__})") from None
    if not names:
        raise AdapterError(WEIGHTS_FILE, "holds no LoRA tensors")
    keys: dict[tuple[int, str], tuple[str, str]] = {}
    for (layer, module), pair in sorted(_match_keys(names, arch).items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(WEIGHTS_FILE, f"layer {layer} {module} lacks lora_A or lora_B")
        out_f, in_f = projection_shape(arch, module)
        for which, want in (("A", (rank, in_f)), ("B", (out_f, rank))):
            got = shapes[pair[which]]
            if got != want:
                raise AdapterError(
                    WEIGHTS_FILE,
                    f"layer {layer} {module} lora_{which} has shape {list(got)}, the model "
                    f"needs {list(want)} (rank {rank})",
                )
        keys[(layer, module)] = (pair["A"], pair["B"])
    return AdapterSpec(str(directory), rank, scaling, keys)


def load_adapter(spec: AdapterSpec) -> AdapterWeights:
    """Read the tensors of a checked adapter (float32, scaling folded into B)."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    with safe_open(str(Path(spec.path) / WEIGHTS_FILE), framework="pt") as f:
        for target, (key_a, key_b) in spec.keys.items():
            a = f.get_tensor(key_a).float()
            b = f.get_tensor(key_b).float() * spec.scaling
            weights[target] = (a, b)
    return AdapterWeights(spec.rank, weights)
