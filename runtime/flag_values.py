"""How engine flag text, and the values ``LLM(**kwargs)`` takes, become config values.

The ``type=`` / ``action=`` of the engine flags (``runtime/engine_args.py``): vLLM's JSON for
``--speculative-config``, human-readable sizes for ``--max-model-len``, ``NAME=PATH`` items for
``--lora-modules``; and the converters of the few ``EngineArgs`` values that ``LLM(**kwargs)``
may pass in another form than the flag's parsed one (``engine_args.TO_CONFIG``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from typing import Any

from tokenwire.runtime.config import SpeculativeConfig


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`` (argparse
    names the flag in front of the message)."""
    try:
        return speculative_config_from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def speculative_config_from_json(text: str) -> SpeculativeConfig:
    try:
        data = json.loads(text)
    except ValueError:
        shown = text if len(text) <= 80 else text[:80] + "..."
        raise ValueError(f"expected a JSON object, got {shown!r}") from None
    return speculative_config(data)


def speculative_config(data: Any) -> SpeculativeConfig:
    """A ``SpeculativeConfig`` from vLLM's JSON keys: unknown keys are refused and
    ``num_speculative_tokens`` is required (as in vLLM). A ``ValueError``'s message names the
    key at fault, not the flag (callers add ``--speculative-config``)."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__} {data!r:.80}")
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown keys {unknown}; known: {sorted(known)}")
    try:
        config = SpeculativeConfig(**data)
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc).removeprefix("speculative_config ")) from None
    if "num_speculative_tokens" not in data:
        raise ValueError("num_speculative_tokens is required (the tokens drafted per step)")
    return config


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgG])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_max_model_len(text: str) -> int | None:
    """``--max-model-len``: ``auto`` (or -1) = the model's own (None); an integer, or vLLM's
    human-readable forms: ``8k`` = 8000, ``25.6k`` = 25600, ``1m`` = 10**6 (decimal), ``8K`` =
    8192, ``1M`` = 2**20 (binary, whole numbers only)."""
    value = text.strip()
    if value.lower() == "auto" or value == "-1":
        return None
    match = _SIZE.fullmatch(value)
    try:
        if match is None:
            return int(value)
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        return int(number) * _BINARY[suffix]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected auto, an integer or a size like 8k / 8K (decimals only with k, m, g), "
            f"got {text!r}"
        ) from None


def parse_lora_module(text: str) -> tuple[str, str]:
    """``NAME=PATH`` (one ``--lora-modules`` item) -> (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


class LoRAModulesAction(argparse.Action):
    """``--lora-modules a=/p b=/q`` (one or more items; repeating the flag adds more)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs["nargs"] = "+"
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, (*getattr(namespace, self.dest, ()), *values))


def speculative_from_value(value: Any) -> SpeculativeConfig | None:
    """``LLM(speculative_config={...})`` takes vLLM's dict as well as the config itself."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    try:
        if isinstance(value, str):  # the flag's JSON text
            return speculative_config_from_json(value)
        return speculative_config(value)
    except ValueError as exc:
        raise ValueError(f"--speculative-config: {exc}") from None


def max_model_len_from_value(value: int | str | None) -> int | None:
    """``LLM(max_model_len="8k")`` parses like the flag."""
    if not isinstance(value, str):
        return value
    try:
        return parse_max_model_len(value)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"max_model_len {exc}") from None
