"""FP8 (e4m3) weights: compressed-tensors / HF ``fp8`` checkpoints and ``--quantization fp8``.

Per linear layer a checkpoint holds ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale``
(``W = weight.float() * scale``):

- compressed-tensors (llm-compressor, ``format: float-quantized``): ``strategy: tensor`` ->
  ``weight_scale [1]``; ``strategy: channel`` -> ``weight_scale [N, 1]``. Input activations
  absent (weight-only) or dynamic per token.
- HF / AutoFP8 ``quant_method: fp8`` with ``activation_scheme: dynamic`` and no
  ``weight_block_size``: ``weight_scale []`` (per tensor). Block-wise scales
  (``weight_scale_inv``) and static activation scales are refused naming the key.
- ``--quantization fp8`` on an unquantized checkpoint: the weight loads in the model dtype and
  is quantized at ``process_weights_after_loading`` with one scale per output row
  (``amax / 448``, torch's round-to-nearest-even cast).

Fused q/k/v and gate/up with per-tensor scales: each checkpoint tensor keeps its own scale
(``weight_scale`` holds one element per fused shard, ``ParamLayout.per_shard``); after loading
they are expanded to one scale per output row of their shard, exactly, with no requantization
(unlike vLLM, which requantizes every shard to the largest scale). Per-channel scales split
along N with the weight; per-tensor scales are whole on every rank. ``apply`` is
``kernels.fp8_matmul`` (``torch._scaled_mm`` with dynamic per-token activation scales on CUDA
sm_89+, de-quantized weights elsewhere).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from tokenwire.kernels.fp8_matmul import FP8_DTYPE, fp8_matmul, prepare_fp8, quantize_fp8_per_row
from tokenwire.runtime.models.layers.quant.base import (
    LinearLayer,
    LinearMethod,
    ParamLayout,
    QuantConfig,
    config_key,
    config_value,
)
from tokenwire.runtime.models.layers.quant.unquantized import WEIGHT_LAYOUT

Strategy = Literal["tensor", "channel"]

_FP8_WEIGHT = ParamLayout(output_dim=0, input_dim=1, dtype=FP8_DTYPE, dummy="skip")
_CHANNEL_SCALE = ParamLayout(output_dim=0, dummy="scale")


@dataclass(frozen=True)
class Fp8Config(QuantConfig):
    """``online``: quantize an unquantized checkpoint at load; else the checkpoint holds fp8
    weights with ``strategy`` scales, per-tensor ones of shape ``tensor_scale_shape``."""

    name: ClassVar[str] = "fp8"
    online: bool = True
    strategy: Strategy = "channel"
    tensor_scale_shape: tuple[int, ...] = (1,)

    @classmethod
    def from_hf(cls, qc: Mapping[str, Any]) -> Fp8Config:
        """HF / AutoFP8 ``quant_method: fp8`` (per-tensor ``weight_scale []``)."""
        if qc.get("weight_block_size") is not None:
            raise ValueError(
                f"{config_key('weight_block_size')}={qc['weight_block_size']!r}: block-wise "
                "fp8 scales (weight_scale_inv) are not supported; per-tensor fp8 only"
            )
        config_value(qc, "activation_scheme", "dynamic", ("dynamic",))
        return cls(online=False, strategy="tensor", tensor_scale_shape=())

    @classmethod
    def from_compressed_tensors(cls, qc: Mapping[str, Any]) -> Fp8Config:
        """llm-compressor's ``float-quantized`` FP8 (one config group on ``Linear``)."""
        config_value(qc, "format", "float-quantized", ("float-quantized",))
        groups = qc.get("config_groups")
        if not isinstance(groups, Mapping) or len(groups) != 1:
            raise ValueError(f"{config_key('config_groups')} must hold exactly one group")
        (group_name, group), *_ = groups.items()
        key = f"config_groups.{group_name}"
        if not isinstance(group, Mapping):
            raise ValueError(f"{config_key(key)} must be an object")
        _check_targets(group.get("targets"), key)
        _check_ignore(qc.get("ignore"))
        if qc.get("kv_cache_scheme") is not None:
            raise ValueError(f"{config_key('kv_cache_scheme')}: use --kv-cache-dtype fp8 instead")
        weights = group.get("weights")
        if not isinstance(weights, Mapping):
            raise ValueError(f"{config_key(key + '.weights')} must be an object")
        _check_fp8_args(weights, f"{key}.weights", dynamic=False)
        strategy = config_value(weights, "strategy", None, ("tensor", "channel"))
        if weights.get("symmetric", True) is not True:
            raise ValueError(f"{config_key(key + '.weights.symmetric')} must be true")
        acts = group.get("input_activations")
        if acts is not None:
            if not isinstance(acts, Mapping):
                raise ValueError(f"{config_key(key + '.input_activations')} must be an object")
            _check_fp8_args(acts, f"{key}.input_activations", dynamic=True)
            config_value(acts, "strategy", "token", ("token",))
        return cls(online=False, strategy=strategy, tensor_scale_shape=(1,))

    def linear_method(self) -> LinearMethod:
        return Fp8LinearMethod(self)


def _check_fp8_args(args: Mapping[str, Any], key: str, *, dynamic: bool) -> None:
    for field, want in (("num_bits", 8), ("type", "float"), ("dynamic", dynamic)):
        if args.get(field) != want:
            raise ValueError(
                f"{config_key(f'{key}.{field}')}={args.get(field)!r} is not supported "
                f"(fp8 needs {want!r})"
            )


def _check_targets(targets: Any, key: str) -> None:
    if targets != ["Linear"]:
        raise ValueError(
            f"{config_key(key + '.targets')}={targets!r}: only ['Linear'] is supported"
        )


def _check_ignore(ignore: Any) -> None:
    """Only the LM head may be left unquantized (it always is here)."""
    for entry in ignore or []:
        if not (isinstance(entry, str) and entry.rpartition(":")[2].endswith("lm_head")):
            raise ValueError(
                f"{config_key('ignore')} entry {entry!r}: only lm_head may be left unquantized"
            )


class Fp8LinearMethod:
    def __init__(self, config: Fp8Config) -> None:
        self.config = config

    @property
    def name(self) -> str:
        return "fp8"

    def create_weights(
        self,
        layer: LinearLayer,
        input_size: int,
        output_size: int,
        dtype: torch.dtype,
        *,
        full_input_size: int,
    ) -> None:
        cfg = self.config
        layer.__dict__["fp8_dtype"] = dtype  # the model dtype ``apply`` computes in
        if cfg.online:
            weight = torch.empty(output_size, input_size, dtype=dtype)
            layer.register("weight", weight, WEIGHT_LAYOUT)
            return
        weight = torch.empty(output_size, input_size, dtype=FP8_DTYPE)
        layer.register("weight", weight, _FP8_WEIGHT)
        if cfg.strategy == "channel":
            scale = torch.empty(output_size, 1, dtype=torch.float32)
            layer.register("weight_scale", scale, _CHANNEL_SCALE)
            return
        shards = len(_shard_lengths(layer, output_size))
        layout = ParamLayout(per_shard=cfg.tensor_scale_shape, dummy="scale")
        layer.register("weight_scale", torch.empty(shards, dtype=torch.float32), layout)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_matmul(x, layer.prepared("fp8"), bias)

    @torch.no_grad()
    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        weight = layer.param("weight")
        dtype = layer.__dict__["fp8_dtype"]
        if self.config.online:
            codes, row_scale = quantize_fp8_per_row(weight)
            scale = row_scale.reshape(-1)
        else:
            codes, scale = weight.data, self._row_scales(layer, weight.shape[0])
        layer.drop("weight", "weight_scale")
        layer.hold("fp8", prepare_fp8(codes, scale, dtype))

    def _row_scales(self, layer: LinearLayer, rows: int) -> torch.Tensor:
        """The checkpoint's scales as one float32 scale per output row ``[N]``."""
        scale = layer.param("weight_scale").float()
        if self.config.strategy == "channel":
            return scale.reshape(-1)
        lengths = torch.tensor(_shard_lengths(layer, rows), device=scale.device)
        return torch.repeat_interleave(scale, lengths)


def _shard_lengths(layer: LinearLayer, output_size: int) -> list[int]:
    """This rank's output rows of each checkpoint tensor fused into ``layer`` (q, k, v or
    gate, up; a single tensor otherwise)."""
    shards = getattr(layer, "output_shards", None)
    if not shards:
        return [output_size]
    return [int(s.length) for s in shards]
