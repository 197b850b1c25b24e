"""Which weight scheme a model runs: ``--quantization`` and the checkpoint's config.json.

- config.json has a ``quantization_config``: its ``quant_method`` (``gptq``, ``awq``) decides;
  ``--quantization`` may repeat it, and contradicting it is a startup error naming the flag.
- no ``quantization_config``: ``--quantization int8`` quantizes the (unquantized) checkpoint
  at load; ``gptq`` / ``awq`` need a checkpoint in that format, except with
  ``--load-format dummy`` (random 4-bit weights with the default settings, for benchmarks).
- neither: unquantized.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, get_args

from tokenwire.runtime.config import QuantizationMethod
from tokenwire.runtime.models.layers.quant.awq import AWQConfig
from tokenwire.runtime.models.layers.quant.base import QuantConfig, config_key
from tokenwire.runtime.models.layers.quant.gptq import GPTQConfig
from tokenwire.runtime.models.layers.quant.int8 import Int8Config

FLAG = "--quantization"
QUANTIZATION_METHODS: tuple[str, ...] = get_args(QuantizationMethod)

# quant_method of a checkpoint's quantization_config -> its parser.
_CHECKPOINT_FORMATS: dict[str, Callable[[Mapping[str, Any]], QuantConfig]] = {
    "gptq": GPTQConfig.from_hf,
    "awq": AWQConfig.from_hf,
}


def resolve_quant_config(
    flag: str | None, hf_config: Mapping[str, Any], *, dummy: bool = False
) -> QuantConfig | None:
    """The scheme for ``--quantization flag`` (None: auto) and this config.json; None means
    unquantized. Raises ValueError naming the flag or the config key at fault."""
    if flag is not None and flag not in QUANTIZATION_METHODS:
        raise ValueError(
            f"{FLAG} {flag!r} is not supported (choose from {', '.join(QUANTIZATION_METHODS)})"
        )
    qc = hf_config.get("quantization_config")
    if qc is None:
        return _from_flag(flag, dummy)
    if not isinstance(qc, Mapping):
        raise ValueError("config.json quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()
    parse = _CHECKPOINT_FORMATS.get(method)
    if parse is None:
        raise ValueError(
            f"{config_key('quant_method')}={qc.get('quant_method')!r} is not supported "
            f"(supported checkpoint formats: {', '.join(_CHECKPOINT_FORMATS)})"
        )
    if flag is not None and flag != method:
        raise ValueError(
            f"{FLAG} {flag} contradicts the checkpoint, which is {method}-quantized "
            f"({config_key('quant_method')}): use {FLAG} {method} or leave {FLAG} unset"
        )
    return parse(qc)


def _from_flag(flag: str | None, dummy: bool) -> QuantConfig | None:
    if flag is None:
        return None
    if flag == "int8":
        return Int8Config()
    if dummy:  # random weights in that format, default settings (4-bit, group 128)
        return GPTQConfig() if flag == "gptq" else AWQConfig()
    raise ValueError(
        f"{FLAG} {flag} needs a {flag.upper()} checkpoint, but config.json has no "
        f"quantization_config (an unquantized checkpoint can be quantized at load with "
        f"{FLAG} int8)"
    )
