"""Which weight scheme a model runs: ``--quantization`` and the checkpoint's config.json.

- config.json has a ``quantization_config``: its ``quant_method`` (``gptq``, ``awq``) decides;
  ``--quantization`` may repeat it, and contradicting it is a startup error naming the flag.
- ``quant_method: fp8`` (HF / AutoFP8) and ``compressed-tensors`` (FP8 ``float-quantized``)
  are both the ``fp8`` scheme.
- no ``quantization_config``: ``--quantization int8`` (or ``fp8``) quantizes the
  (unquantized) checkpoint at load; ``gptq`` / ``awq`` need a checkpoint in that format, except with
  ``--load-format dummy`` (random 4-bit weights with the default settings, for benchmarks).
- neither: unquantized.
- ``quant_method: mxfp4`` (gpt-oss's published checkpoints): no linear scheme; the experts
  stay MXFP4 where the Triton kernels run (``runtime/models/gpt_oss_mxfp4.py``) and are
  de-quantized exactly at load elsewhere (``runtime/models/gpt_oss_checkpoint.py``); any other
  architecture, or any ``--quantization``, is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, get_args

from tokenwire.runtime.config import QuantizationMethod
from tokenwire.runtime.models.layers.quant.awq import AWQConfig
from tokenwire.runtime.models.layers.quant.base import QuantConfig, config_key
from tokenwire.runtime.models.layers.quant.fp8 import Fp8Config
from tokenwire.runtime.models.layers.quant.gptq import GPTQConfig
from tokenwire.runtime.models.layers.quant.int8 import Int8Config

FLAG = "--quantization"
QUANTIZATION_METHODS: tuple[str, ...] = get_args(QuantizationMethod)

# quant_method of a checkpoint's quantization_config -> its parser.
_CHECKPOINT_FORMATS: dict[str, Callable[[Mapping[str, Any]], QuantConfig]] = {
    "gptq": GPTQConfig.from_hf,
    "fp8": Fp8Config.from_hf,
    "compressed-tensors": Fp8Config.from_compressed_tensors,
    "awq": AWQConfig.from_hf,
}


# A checkpoint format whose scheme has another --quantization name.
_SCHEME_OF_FORMAT = {"compressed-tensors": "fp8"}  # FP8 is the only compressed-tensors scheme


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
    if method == "mxfp4":
        _check_mxfp4(flag, qc, hf_config)
        return None
    parse = _CHECKPOINT_FORMATS.get(method)
    if parse is None:
        raise ValueError(
            f"{config_key('quant_method')}={qc.get('quant_method')!r} is not supported "
            f"(supported checkpoint formats: {', '.join(_CHECKPOINT_FORMATS)})"
        )
    method = _SCHEME_OF_FORMAT.get(method, method)
    if flag is not None and flag != method:
        raise ValueError(
            f"{FLAG} {flag} contradicts the checkpoint, which is {method}-quantized "
            f"({config_key('quant_method')}): use {FLAG} {method} or leave {FLAG} unset"
        )
    return parse(qc)


def _check_mxfp4(flag: str | None, qc: Mapping[str, Any], hf_config: Mapping[str, Any]) -> None:
    """An MXFP4 checkpoint: gpt-oss only, no ``--quantization``."""
    architectures = hf_config.get("architectures") or []
    if hf_config.get("model_type") != "gpt_oss" and "GptOssForCausalLM" not in architectures:
        raise ValueError(
            f"{config_key('quant_method')}='mxfp4' is supported for gpt-oss "
            f"(GptOssForCausalLM) only, not {architectures or hf_config.get('model_type')}"
        )
    skipped = qc.get("modules_to_not_convert", [])
    if not isinstance(skipped, list) or not all(isinstance(m, str) for m in skipped):
        raise ValueError(f"{config_key('modules_to_not_convert')} must be a list of names")
    if flag is not None:
        raise ValueError(
            f"{FLAG} {flag} contradicts the checkpoint, which is mxfp4-quantized "
            f"({config_key('quant_method')}; its experts load de-quantized): leave {FLAG} unset"
        )


def _from_flag(flag: str | None, dummy: bool) -> QuantConfig | None:
    if flag is None:
        return None
    if flag == "int8":
        return Int8Config()
    if flag == "fp8":
        return Fp8Config()  # online: per-channel fp8 of the unquantized weights
    if flag == "gguf":
        raise ValueError(f"{FLAG} gguf needs a .gguf model file (or --load-format gguf)")
    if dummy:  # random weights in that format, default settings (4-bit, group 128)
        return GPTQConfig() if flag == "gptq" else AWQConfig()
    raise ValueError(
        f"{FLAG} {flag} needs a {flag.upper()} checkpoint, but config.json has no "
        f"quantization_config (an unquantized checkpoint can be quantized at load with "
        f"{FLAG} int8)"
    )
