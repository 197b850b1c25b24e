"""``--quantization int8``: online per-channel symmetric int8 weight-only quantization of
an unquantized checkpoint, into the canonical int8 (w8a16) layout.

The layer loads the checkpoint's ``weight [N, K]`` in the model dtype (same parameters and
splits as the unquantized method), then ``process_weights_after_loading`` replaces it by
int8 codes and one scale per output row: ``scale = max|W[n, :]| / 127``, ``code =
round(W / scale)`` (a zero row keeps scale 0). Under tensor parallelism each rank quantizes
its own slice, so a row-parallel layer's scales are per rank (per output row of its K share).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from tokenwire.kernels.quant_matmul import prepare_w8a16, w8a16_matmul
from tokenwire.runtime.models.layers.quant.base import (
    LinearLayer,
    LinearMethod,
    QuantConfig,
)
from tokenwire.runtime.models.layers.quant.unquantized import WEIGHT_LAYOUT


@dataclass(frozen=True)
class Int8Config(QuantConfig):
    name: ClassVar[str] = "int8"

    def linear_method(self) -> LinearMethod:
        return Int8LinearMethod()


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (int8 codes ``[N, K]``, float32 scales ``[N]``)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


class Int8LinearMethod:
    @property
    def name(self) -> str:
        return "int8"

    def create_weights(
        self,
        layer: LinearLayer,
        input_size: int,
        output_size: int,
        dtype: torch.dtype,
        *,
        full_input_size: int,
    ) -> None:
        layer.register("weight", torch.empty(output_size, input_size, dtype=dtype), WEIGHT_LAYOUT)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return w8a16_matmul(x, layer.prepared("w8a16"), bias)

    @torch.no_grad()
    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        weight = layer.param("weight")
        codes, scale = quantize_per_channel(weight)
        dtype, device = weight.dtype, weight.device
        layer.drop("weight")
        scales = scale.to(dtype)[:, None]
        layer.hold("w8a16", prepare_w8a16(codes, scales, codes.shape[1], device, dtype))
