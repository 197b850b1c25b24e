"""AWQ checkpoints (AutoAWQ's GEMM format), 4-bit weight-only, converted at load into the
canonical int4 layout.

Per linear layer (K input, N output features, G = K / group_size groups):
- ``qweight`` int32 ``[K, N / 8]``: int4 codes packed along N in AWQ's interleaved order
  (nibble i of word c holds column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``);
- ``qzeros`` int32 ``[G, N / 8]``: zero points, packed the same way (stored as is);
- ``scales`` ``[G, N]`` (float16). ``W[n, k] = (code - zero) * scale`` of k's group.

Tensor parallelism: column-parallel layers split N (the packed N / 8 of ``qweight`` and
``qzeros``, and ``scales``); row-parallel layers split K (``qweight`` rows and the groups).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tokenwire.kernels.quant_matmul import prepare_w4a16, w4a16_matmul
from tokenwire.runtime.models.layers.quant.base import (
    LinearLayer,
    LinearMethod,
    ParamLayout,
    QuantConfig,
    config_key,
    config_value,
    local_features,
)
from tokenwire.runtime.models.layers.quant.packing import awq_unpack_columns, pack_int4_rows


@dataclass(frozen=True)
class AWQConfig(QuantConfig):
    name: ClassVar[str] = "awq"
    group_size: int = 128  # -1: one group spans all input features

    @classmethod
    def from_hf(cls, qc: Mapping[str, Any]) -> AWQConfig:
        """Parse config.json's ``quantization_config`` (errors name the key)."""
        # transformers spells the bit width "bits", AutoAWQ's own files "w_bit".
        config_value(qc, "bits", qc.get("w_bit", 4), (4,))
        config_value(qc, "zero_point", True, (True,))
        version = str(config_value(qc, "version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"{config_key('version')}={version!r} is not supported (supported: 'gemm')"
            )
        if qc.get("modules_to_not_convert"):
            raise ValueError(
                f"{config_key('modules_to_not_convert')}={qc['modules_to_not_convert']!r} "
                "is not supported"
            )
        group_size = int(config_value(qc, "group_size", qc.get("q_group_size", 128)))
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"{config_key('group_size')}={group_size} must be > 0 or -1")
        return cls(group_size=group_size)

    def linear_method(self) -> LinearMethod:
        return AWQLinearMethod(self)


class AWQLinearMethod:
    def __init__(self, config: AWQConfig) -> None:
        self.config = config

    @property
    def name(self) -> str:
        return "awq"

    def create_weights(
        self,
        layer: LinearLayer,
        input_size: int,
        output_size: int,
        dtype: torch.dtype,
        *,
        full_input_size: int,
    ) -> None:
        split = input_size != full_input_size
        channelwise = self.config.group_size == -1
        group = full_input_size if channelwise else self.config.group_size
        cols = local_features(output_size, 8, layer.what, "qweight", False)
        groups = (
            1 if channelwise else local_features(input_size, group, layer.what, "scales", split)
        )
        group_dim = None if channelwise else 0
        i32 = torch.int32
        layer.register(
            "qweight",
            torch.empty(input_size, cols, dtype=i32),
            ParamLayout(output_dim=1, input_dim=0, output_pack=8, dtype=i32, dummy="bits"),
        )
        layer.register(
            "qzeros",
            torch.empty(groups, cols, dtype=i32),
            ParamLayout(1, group_dim, 8, group, dtype=i32, dummy="bits"),
        )
        layer.register(
            "scales",
            torch.empty(groups, output_size, dtype=dtype),
            ParamLayout(1, group_dim, 1, group, dummy="scale"),
        )

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return w4a16_matmul(x, layer.prepared("w4a16"), bias)

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        scales = layer.param("scales")
        qweight = pack_int4_rows(awq_unpack_columns(layer.param("qweight")))
        zeros = awq_unpack_columns(layer.param("qzeros")).to(scales.dtype)
        k_local = layer.param("qweight").shape[0]
        group = k_local if self.config.group_size == -1 else self.config.group_size
        prepared = prepare_w4a16(qweight, scales, zeros, None, group, scales.device, scales.dtype)
        layer.drop("qweight", "qzeros", "scales")
        layer.hold("w4a16", prepared)
