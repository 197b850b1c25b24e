"""One-time GGUF -> HF safetensors conversion, cached on disk.

transformers dequantises a GGUF in ~20 s for SmolLM2-135M; the converted directory
(config.json, generation_config.json, float32 model.safetensors, tokenizer files) then loads
in well under a second with memory-mapped safetensors.

Cache key: file name + size + mtime (ns) + ``CONVERSION_FORMAT``. This is how make and
ccache detect changed inputs: it costs one ``stat`` per start, whereas a content hash would
read the whole file (seconds for multi-GB GGUFs) on every start. Any replacement of the file
(pip reinstall, copy, download) changes its mtime, so a stale hit needs an in-place rewrite
that preserves both size and mtime to the nanosecond.

Atomicity: conversion writes into a fresh temporary directory beside the final one and
renames it into place; ``rename`` is atomic, so the final directory is either absent or
complete. A killed conversion leaves only a ``.tmp-*`` directory, never a broken cache, and
two concurrent conversions both succeed (the loser discards its copy).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tokenwire.runtime.loader.gguf.config import hf_config_keys

# Bump when the layout written by ``_convert_into`` changes, to invalidate old caches.
CONVERSION_FORMAT = 2  # 2: the config keys of ``gguf.config.hf_config_keys``


def cache_root() -> Path:
    """``$TOKENWIRE_CACHE_DIR``, else ``$XDG_CACHE_HOME/tokenwire``, else ~/.cache/tokenwire."""
    explicit = os.environ.get("TOKENWIRE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "tokenwire"


def converted_dir(gguf_path: Path) -> Path:
    """Where the conversion of ``gguf_path`` lives (whether or not it exists yet)."""
    stat = gguf_path.stat()
    ident = f"{gguf_path.name}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERSION_FORMAT}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


def ensure_converted(gguf_path: Path) -> Path:
    """Return the HF-format directory for ``gguf_path``, converting it on first use."""
    target = converted_dir(gguf_path)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        _convert_into(gguf_path, tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first; keep its copy. Re-raise if it is not there.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_into(gguf_path: Path, out: Path) -> None:
    """Dequantise with transformers and write an HF directory into ``out``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_path.parent, gguf_path.name
    # float32 keeps the dequantised values exact (Q4/Q8 scales are fp16 products).
    # The config keys transformers' GGUF conversion misses (expert width, soft-caps, LongRoPE,
    # ...: ``gguf.config``) apply before it builds the model.
    extra = hf_config_keys(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, **extra
    )
    config = model.config.to_dict()
    # The model is plain float32 now; a leftover quantization_config would make loaders
    # (and transformers' save_pretrained) treat it as still quantised.
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    model.generation_config.to_json_file(out / "generation_config.json")

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)
    source = {"gguf_file": name, "format": CONVERSION_FORMAT}
    (out / "tokenwire_source.json").write_text(json.dumps(source))
