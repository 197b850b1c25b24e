"""Where a model's config, weights and tokenizer come from (no torch): the default model's
converted GGUF, a local HF directory or .gguf file, a bundled config for dummy weights, or a
hub id's cached snapshot. ``model_loader`` loads from it; ``generation_config`` reads the
model's own sampling defaults from the same place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.loader.bundled_configs import BUNDLED_CONFIGS, bundled_config_path
from tokenwire.runtime.loader.default_model import DEFAULT_SERVED_MODEL_NAME, default_gguf_path
from tokenwire.runtime.loader.gguf_convert import ensure_converted
from tokenwire.runtime.loader.hub import (
    CONFIG_PATTERNS,
    WEIGHT_PATTERNS,
    looks_like_hub_id,
    resolve_hub_id,
)


@dataclass(frozen=True)
class ModelSource:
    folder: Path  # HF-format directory (weights, tokenizer, generation_config.json)
    config_file: Path
    served_name: str  # default served model name: directory name or GGUF file stem
    gguf: Path | None = None  # the .gguf file the folder was converted from


def _hf_dir(folder: Path, served_name: str, gguf: Path | None = None) -> ModelSource:
    if not (folder / "config.json").is_file():
        raise ValueError(f"model: {folder} has no config.json")
    return ModelSource(folder, folder / "config.json", served_name, gguf)


def model_source(model_config: ModelConfig) -> ModelSource:
    """Where the model's config, weights and tokenizer come from (a hub id: its snapshot)."""
    if model_config.model is None:
        if model_config.load_format not in ("auto", "gguf"):
            raise ValueError(
                f"load_format={model_config.load_format!r} needs a model path "
                "(the default model is a GGUF file)"
            )
        gguf_file = default_gguf_path()
        return _hf_dir(ensure_converted(gguf_file), DEFAULT_SERVED_MODEL_NAME, gguf_file)
    path = Path(model_config.model).expanduser()
    fmt = model_config.load_format
    hub_id: str | None = None
    if not path.exists():
        bundled = bundled_config_path(model_config.model) if fmt == "dummy" else None
        if bundled is not None:
            return ModelSource(bundled.parent, bundled, bundled.parent.name)
        if not looks_like_hub_id(model_config.model):
            raise ValueError(
                f"model: {model_config.model!r} does not exist (expected a local HF directory "
                "with config.json + *.safetensors, a .gguf file, or a Hugging Face hub id "
                "ORG/NAME; with --load-format dummy also one of the bundled configs: "
                f"{', '.join(BUNDLED_CONFIGS)})"
            )
        hub_id, path = model_config.model, _hub_snapshot(model_config)
    if fmt == "dummy" and path.is_file():  # a bare config.json
        return ModelSource(path.parent, path, path.parent.name)
    config_less = hub_id is not None and not (path / "config.json").is_file()
    gguf_repo = config_less and any(path.glob("*.gguf"))
    if fmt == "gguf" or (fmt == "auto" and (path.suffix == ".gguf" or gguf_repo)):
        gguf = _single_gguf(path)
        return _hf_dir(ensure_converted(gguf), hub_id or gguf.stem, gguf)
    if path.is_file():
        raise ValueError(f"model: {model_config.model!r} is a file; expected a directory or .gguf")
    return _hf_dir(path, hub_id or path.name)


def _hub_snapshot(model_config: ModelConfig) -> Path:
    """The cached (or downloaded) snapshot of hub id ``model``: config and tokenizer files,
    plus the weights unless they are dummy (a .gguf only with ``--load-format gguf``)."""
    fmt = model_config.load_format
    weights = {"dummy": (), "gguf": ("*.gguf",)}.get(fmt, WEIGHT_PATTERNS)
    return resolve_hub_id(
        str(model_config.model),
        param="model",
        revision=model_config.revision,
        download_dir=model_config.download_dir,
        patterns=CONFIG_PATTERNS + weights,
    )


def _single_gguf(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(path.glob("*.gguf"))
    if len(found) != 1:
        raise ValueError(f"model: expected exactly one .gguf file in {path}, found {len(found)}")
    return found[0]
