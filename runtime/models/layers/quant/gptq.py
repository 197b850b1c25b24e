"""GPTQ checkpoints (AutoGPTQ / GPTQModel layout), 4-bit (and symmetric 8-bit) weight-only.

Per linear layer the checkpoint holds (K input, N output features, G groups):
- ``qweight`` int32 ``[K * bits / 32, N]``: ``32 // bits`` codes per word along K, in order;
- ``qzeros`` int32 ``[G, N * bits / 32]``: zero points packed along N; GPTQ v1
  (``checkpoint_format: gptq``) stores ``zero - 1``, v2 (``gptq_v2``) the zero itself;
- ``scales`` ``[G, N]`` (float16); ``g_idx`` int32 ``[K]``: the group of each input row.
``desc_act`` (act order) permutes which rows form a group, so ``g_idx`` matters; without it
the groups are ``k // group_size`` and ``g_idx`` is ignored (it may be absent).

4-bit weights are already the canonical int4 layout (``qweight`` as is, zeros unpacked + 1
for v1); symmetric 8-bit weights become the canonical int8 layout (codes - 128, transposed).
Tensor parallelism: column-parallel layers split N (and ``qzeros``' packed N); row-parallel
layers split K (``qweight`` rows, ``g_idx`` and the groups of ``scales`` / ``qzeros``). With
act order a row-parallel rank's rows reference groups anywhere, so it keeps every group of
``scales`` / ``qzeros`` (as vLLM does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tokenwire.kernels.quant_matmul import (
    prepare_w4a16,
    prepare_w8a16,
    w4a16_matmul,
    w8a16_matmul,
)
from tokenwire.runtime.models.layers.quant.base import (
    LinearLayer,
    LinearMethod,
    ParamLayout,
    QuantConfig,
    config_key,
    config_value,
    local_features,
)
from tokenwire.runtime.models.layers.quant.packing import unpack_int32


@dataclass(frozen=True)
class GPTQConfig(QuantConfig):
    name: ClassVar[str] = "gptq"
    bits: int = 4
    group_size: int = 128  # -1: one group spans all input features
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # "gptq" (v1: zero - 1 stored) or "gptq_v2"

    @classmethod
    def from_hf(cls, qc: Mapping[str, Any]) -> GPTQConfig:
        """Parse config.json's ``quantization_config`` (errors name the key)."""
        if qc.get("is_marlin_format"):
            raise ValueError(
                f"{config_key('is_marlin_format')}: Marlin-packed GPTQ is not supported"
            )
        for key in ("dynamic", "lm_head"):
            if qc.get(key):
                raise ValueError(f"{config_key(key)}={qc[key]!r} is not supported")
        config = cls(
            bits=int(config_value(qc, "bits", None, (4, 8))),
            group_size=int(config_value(qc, "group_size", 128)),
            sym=bool(config_value(qc, "sym", True, (True, False))),
            desc_act=bool(config_value(qc, "desc_act", False, (True, False))),
            checkpoint_format=str(config_value(qc, "checkpoint_format", "gptq", _FORMATS)),
        )
        if config.group_size != -1 and config.group_size <= 0:
            raise ValueError(f"{config_key('group_size')}={config.group_size} must be > 0 or -1")
        if config.bits == 8 and not config.sym:
            raise ValueError(f"{config_key('sym')}=false: 8-bit GPTQ must be symmetric here")
        if config.bits == 8 and config.desc_act and config.group_size != -1:
            raise ValueError(f"{config_key('desc_act')}=true is not supported with 8-bit GPTQ")
        return config

    def linear_method(self) -> LinearMethod:
        return GPTQLinearMethod(self)


_FORMATS = ("gptq", "gptq_v2")


class GPTQLinearMethod:
    def __init__(self, config: GPTQConfig) -> None:
        self.config = config

    @property
    def name(self) -> str:
        return "gptq"

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
        pack = 32 // cfg.bits
        split = input_size != full_input_size
        channelwise = cfg.group_size == -1
        group = full_input_size if channelwise else cfg.group_size
        # Act order under a row split: any row may use any group, so keep them all.
        whole = channelwise or (cfg.desc_act and split)
        rows = local_features(input_size, pack, layer.what, "qweight", split)
        cols = local_features(output_size, pack, layer.what, "qzeros", False)
        if channelwise:
            groups = 1
        elif whole:
            groups = local_features(full_input_size, group, layer.what, "scales", False)
        else:
            groups = local_features(input_size, group, layer.what, "scales", split)
        group_dim = None if whole else 0
        i32 = torch.int32
        layer.register(
            "qweight",
            torch.empty(rows, output_size, dtype=i32),
            ParamLayout(output_dim=1, input_dim=0, input_pack=pack, dtype=i32, dummy="bits"),
        )
        layer.register(
            "qzeros",
            torch.empty(groups, cols, dtype=i32),
            ParamLayout(1, group_dim, pack, group, dtype=i32, dummy="bits"),
        )
        layer.register(
            "scales",
            torch.empty(groups, output_size, dtype=dtype),
            ParamLayout(1, group_dim, 1, group, dummy="scale"),
        )
        layer.register(
            "g_idx",
            torch.empty(input_size, dtype=i32),
            ParamLayout(input_dim=0, dtype=i32, optional=not cfg.desc_act, dummy="skip"),
        )

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.config.bits == 4:
            return w4a16_matmul(x, layer.prepared("w4a16"), bias)
        return w8a16_matmul(x, layer.prepared("w8a16"), bias)

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        cfg = self.config
        zeros = unpack_int32(layer.param("qzeros"), cfg.bits, dim=1)
        if cfg.checkpoint_format == "gptq":
            zeros = zeros + 1  # v1 stores zero - 1
        if cfg.bits == 4:
            self._prepare_int4(layer, zeros)
        else:
            self._prepare_int8(layer, zeros)
        layer.drop("qweight", "qzeros", "scales", "g_idx")

    def _group(self, qweight: torch.Tensor) -> int:
        k_local = qweight.shape[0] * (32 // self.config.bits)
        return k_local if self.config.group_size == -1 else self.config.group_size

    def _prepare_int4(self, layer: LinearLayer, zeros: torch.Tensor) -> None:
        """The checkpoint's qweight is already the canonical int4 layout."""
        qweight, scales = layer.param("qweight"), layer.param("scales")
        act_order = self.config.desc_act and layer.has_data("g_idx")
        g_idx = layer.param("g_idx") if act_order else None
        dtype = scales.dtype
        prepared = prepare_w4a16(
            qweight, scales, zeros.to(dtype), g_idx, self._group(qweight), scales.device, dtype
        )
        layer.hold("w4a16", prepared)

    def _prepare_int8(self, layer: LinearLayer, zeros: torch.Tensor) -> None:
        """Symmetric 8-bit: signed codes (code - 128), transposed to ``[N, K]``."""
        if not bool((zeros == 128).all()):
            raise ValueError(
                "qzeros: 8-bit GPTQ zero points must all be 128 (symmetric); "
                "asymmetric 8-bit weights are not supported"
            )
        qweight, scales = layer.param("qweight"), layer.param("scales")
        codes = (unpack_int32(qweight, 8, dim=0) - 128).to(torch.int8).t().contiguous()
        scales_nk = scales.t().contiguous()
        prepared = prepare_w8a16(
            codes, scales_nk, self._group(qweight), scales.device, scales.dtype
        )
        layer.hold("w8a16", prepared)
