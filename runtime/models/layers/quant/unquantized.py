"""The unquantized linear method: ``weight [out, in]`` in the model dtype, ``F.linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenwire.runtime.models.layers.quant.base import LinearLayer, ParamLayout

# weight [N, K]: output features along dim 0, input features along dim 1.
WEIGHT_LAYOUT = ParamLayout(output_dim=0, input_dim=1)


class UnquantizedLinearMethod:
    """Today's behaviour: a plain ``[out, in]`` weight parameter named ``weight``."""

    @property
    def name(self) -> str:
        return ""

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
        return F.linear(x, layer.param("weight"), bias)

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        pass
