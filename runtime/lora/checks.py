"""What a PEFT LoRA adapter directory must hold, checked without the model (no torch).

``read_adapter`` reads ``adapter_config.json`` and the safetensors header (never tensor
data) through the bounded readers of ``files`` and checks everything that needs no model:
PEFT type, options this engine implements, rank (an integer in ``[1, --max-lora-rank]``),
``lora_alpha`` (a bounded number), the tensor names (one ``lora_A`` / ``lora_B`` pair per
targeted projection), their dtypes, and that every A is ``[r, in]`` and every B ``[out, r]``
for the config's ``r``. The front runs it before an adapter reaches the engine core, and
the core runs it again (with the model's shapes on top, ``adapter.inspect_adapter``); it
raises nothing but ``AdapterError``.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenwire.runtime.errors import AdapterError
from tokenwire.runtime.lora.files import TensorInfo, read_json_file, read_safetensors_header
from tokenwire.runtime.lora.request import CONFIG_FILE, WEIGHTS_FILE

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
MAX_LAYERS = 1 << 16  # a layer index beyond any model's (the model's own count is checked later)
MAX_LORA_ALPHA = 1 << 20
# A decoder layer's tensor: a causal LM's (``model.layers``) or a vision-language model's
# language model (``model.language_model.layers``, transformers >= 4.52; ``language_model.model
# .layers``, earlier LLaVA checkpoints). LoRA applies to the language model only.
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.layers|model\.language_model\.layers"
    r"|language_model\.model\.layers)\.(\d{1,6})\.(self_attn|mlp)\.(\w{1,64})"
    r"\.lora_([AB])\.weight$",
    re.ASCII,
)
# A vision-language model's image side: refused by name (LoRA on the language model only).
_VISION = re.compile(r"(?:^|\.)(?:vision_tower|vision_model|multi_modal_projector)\.", re.ASCII)
# Config keys whose non-default value changes the maths this engine implements.
_UNSUPPORTED: dict[str, Any] = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}
_SHOWN_CHARS = 64


def _shown(value: Any) -> str:
    """A short, printable rendering of a config value for a message."""
    text = ascii(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "…"


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter directory's checked contents (no tensor data)."""

    rank: int
    scaling: float
    # (layer index, module name) -> the A and B tensor names
    keys: dict[tuple[int, str], tuple[str, str]]
    tensors: dict[str, TensorInfo]


def _config(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):  # never raises (a NUL, a name too long: False)
        raise AdapterError("lora_path", "is not a directory")
    config = read_json_file(Path(path) / CONFIG_FILE, CONFIG_FILE)
    if not isinstance(config, dict):
        raise AdapterError(CONFIG_FILE, "must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise AdapterError(f"{CONFIG_FILE}:peft_type", f"must be LORA, got {_shown(peft_type)}")
    for key, default in _UNSUPPORTED.items():
        value = config.get(key, default)
        if value not in (default, None, {}, False):
            raise AdapterError(f"{CONFIG_FILE}:{key}", "is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{CONFIG_FILE}:bias", "only 'none' is supported")
    return config


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _scaling(config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise AdapterError(f"{CONFIG_FILE}:r", f"must be a positive integer, got {_shown(rank)}")
    if rank > max_rank:
        raise AdapterError(f"{CONFIG_FILE}:r", f"rank {rank} exceeds --max-lora-rank ({max_rank})")
    alpha = config.get("lora_alpha", rank)
    if not _is_number(alpha) or not abs(alpha) <= MAX_LORA_ALPHA:
        raise AdapterError(
            f"{CONFIG_FILE}:lora_alpha",
            f"must be a number in [-{MAX_LORA_ALPHA}, {MAX_LORA_ALPHA}], got {_shown(alpha)}",
        )
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool | None):
        raise AdapterError(f"{CONFIG_FILE}:use_rslora", f"must be a boolean, got {_shown(rslora)}")
    denom = math.sqrt(rank) if rslora else rank
    return rank, float(alpha) / denom


def _check_targets(config: dict[str, Any]) -> None:
    targets = config.get("target_modules")
    if isinstance(targets, list):
        if not all(isinstance(t, str) for t in targets):
            raise AdapterError(f"{CONFIG_FILE}:target_modules", "must be a list of names")
        unknown = sorted(t for t in targets if t.split(".")[-1] not in TARGET_MODULES)
        if unknown:
            raise AdapterError(
                f"{CONFIG_FILE}:target_modules",
                f"unsupported target module(s) {_shown(unknown)}; supported: "
                f"{sorted(TARGET_MODULES)}",
            )


def _pairs(names: list[str]) -> dict[tuple[int, str], tuple[str, str]]:
    """(layer, module) -> (A name, B name): every tensor is one of a LoRA pair."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name in names:
        m = _KEY.match(name)
        if m is None and _VISION.search(name):
            raise AdapterError(
                WEIGHTS_FILE,
                f"LoRA tensor {_shown(name)} targets the vision encoder or projector; LoRA "
                "applies to the language model only (target its layers, e.g. "
                "target_modules='.*language_model.*\\.(q_proj|v_proj)')",
            )
        if m is None:
            raise AdapterError(WEIGHTS_FILE, f"unsupported LoRA tensor {_shown(name)}")
        layer, block, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if TARGET_MODULES.get(module) != block:
            raise AdapterError(WEIGHTS_FILE, f"unsupported target module {block}.{module}")
        if layer >= MAX_LAYERS:
            raise AdapterError(WEIGHTS_FILE, f"layer {layer} does not exist")
        found.setdefault((layer, module), {})[which] = name
    pairs: dict[tuple[int, str], tuple[str, str]] = {}
    for (layer, module), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(WEIGHTS_FILE, f"layer {layer} {module} lacks lora_A or lora_B")
        pairs[(layer, module)] = (pair["A"], pair["B"])
    return pairs


def _check_ranks(
    pairs: dict[tuple[int, str], tuple[str, str]], tensors: dict[str, TensorInfo], rank: int
) -> None:
    for (layer, module), (key_a, key_b) in pairs.items():
        a, b = tensors[key_a].shape, tensors[key_b].shape
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise AdapterError(
                WEIGHTS_FILE,
                f"layer {layer} {module} has lora_A shape {list(a)} and lora_B shape "
                f"{list(b)}; rank {rank} needs [{rank}, in] and [out, {rank}]",
            )


def read_adapter(path: str, max_rank: int) -> AdapterFiles:
    """Check a PEFT adapter directory's files; ``AdapterError`` names what is wrong."""
    directory = Path(path)
    config = _config(path)
    rank, scaling = _scaling(config, max_rank)
    _check_targets(config)
    tensors = read_safetensors_header(directory / WEIGHTS_FILE, WEIGHTS_FILE)
    if not tensors:
        raise AdapterError(WEIGHTS_FILE, "holds no LoRA tensors")
    pairs = _pairs(sorted(tensors))
    _check_ranks(pairs, tensors, rank)
    return AdapterFiles(rank, scaling, pairs, tensors)
