"""Default sampling parameters from the model's generation config (vLLM's
``--generation-config``).

``auto`` (the default, as in vLLM): the model's ``generation_config.json`` (its directory or hub
snapshot) supplies the defaults of ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``) -- every one of these the
file sets. A GGUF source adds its ``general.sampling.*`` metadata (llama.cpp's converter writes
it from the same file), and the built-in default model has its own, greedy and nothing else
(``default_model.DEFAULT_MODEL_SAMPLING``); a generation_config.json wins over both.
``vllm``: none (tokenwire's built-in ``SamplingParams`` defaults). Anything else: a folder
holding a generation_config.json.

The defaults apply to the fields a request leaves unset (each front decides what "unset" is:
an absent optional proto field, an OpenAI field not sent, ``sampling_params=None`` offline).
As in vLLM, ``do_sample`` is not read: a file's temperature applies either way. Unlike
vLLM, a default ``repetition_penalty`` is not applied to constrained decoding (a structured
output, a required or named tool choice): those answers copy from the prompt, which the
penalty works against; a request that sets one gets it (``server/grpc/convert.py``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.loader.default_model import DEFAULT_MODEL_SAMPLING
from tokenwire.runtime.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field (vLLM's list of keys).
_HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# GGUF metadata key (llama.cpp's general.sampling.*) -> SamplingParams field.
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_INT_FIELDS = ("top_k", "max_tokens")
_GGUF_MARKER = "tokenwire_source.json"  # written into a converted GGUF's directory
_log = logging.getLogger(__name__)

SamplingDefaults = dict[str, float | int]


def default_sampling(
    model_config: ModelConfig, model_path: str | Path, gguf: Path | None
) -> SamplingDefaults:
    """The default sampling parameters for requests to this model (may be empty).

    ``model_path`` is the loaded model's HF-format directory (a hub snapshot, or a GGUF's
    converted directory), ``gguf`` the .gguf file it came from. A bad file or value is a
    ``ValueError`` naming ``generation_config``."""
    mode = model_config.generation_config
    if mode == "vllm":
        return {}
    if mode != "auto":
        folder = Path(mode).expanduser()
        if not (folder / GENERATION_CONFIG_FILE).is_file():
            raise ValueError(
                f"generation_config: {mode!r} is not a folder holding {GENERATION_CONFIG_FILE} "
                "(expected auto, vllm or such a folder)"
            )
        return _checked(from_folder(folder), str(folder / GENERATION_CONFIG_FILE))
    found: SamplingDefaults = {}
    sources: list[str] = []
    if model_config.model is None and model_config.load_format != "dummy":
        found.update(DEFAULT_MODEL_SAMPLING)
        sources.append("the default model's built-in defaults")
    folder = Path(model_path)
    if gguf is not None and (from_file := from_gguf(gguf)):
        found.update(from_file)
        sources.append(str(gguf))
    if from_json := from_folder(folder):
        found.update(from_json)
        sources.append(str(folder / GENERATION_CONFIG_FILE))
    return _checked(found, " + ".join(sources))


def from_folder(folder: Path) -> SamplingDefaults:
    """The sampling keys ``folder/generation_config.json`` sets (none when it is absent)."""
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"generation_config: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {path} is not a JSON object")
    return _pick(data, _HF_KEYS, str(path))


def from_gguf(path: Path) -> SamplingDefaults:
    """The ``general.sampling.*`` metadata of a .gguf file (none when it has none)."""
    from tokenwire.runtime.loader.gguf.container import open_gguf

    return _pick(open_gguf(path).metadata, _GGUF_KEYS, str(path))


def _pick(data: Mapping[str, Any], keys: Mapping[str, str], source: str) -> SamplingDefaults:
    picked: SamplingDefaults = {}
    for key, name in keys.items():
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"generation_config: {source}: {key} must be a number, got {value!r}")
        picked[name] = int(value) if name in _INT_FIELDS else float(value)
    return picked


def _checked(defaults: SamplingDefaults, source: str) -> SamplingDefaults:
    """``defaults`` if they make valid ``SamplingParams``; a ValueError naming the source."""
    try:
        SamplingParams(**defaults)  # type: ignore[arg-type]
    except ParameterError as exc:
        raise ValueError(f"generation_config: {source} sets an invalid {exc}") from None
    return defaults


def loaded_model_defaults(model_config: ModelConfig, model_path: str | Path) -> SamplingDefaults:
    """``default_sampling`` of a loaded model, given only its directory (``ModelFacts``): a
    converted GGUF's source file is found again (resolved from caches, cheap). The loader has
    already checked the same inputs, so this fails only if files changed since."""
    gguf = None
    if (Path(model_path) / _GGUF_MARKER).is_file():
        from tokenwire.runtime.loader.source import model_source

        gguf = model_source(model_config).gguf
    defaults = default_sampling(model_config, model_path, gguf)
    if defaults:
        mode = model_config.generation_config
        _log.info("default sampling parameters (--generation-config %s): %s", mode, defaults)
    return defaults
