"""GGUF fused layers kept quantized part by part: Q4_K_M's Q4_K q/k beside its Q6_K v (and
any layer with a Q5_K part), on ``kernels.vnni_parts``.

Every part of such a layer is loaded into one canonical layout that holds them all exactly
(``kquant_tensors``: int8 codes ``[N, K]``, float32 scales per 16 inputs, float32 minimums per
32; ``W = code * scale + min``), so the fused q/k/v or gate/up parameter loads its shards as
any other; ``process_weights_after_loading`` then packs each part in its own kind (int4
for Q4_0 / Q4_1 / Q4_K rows, int8 for Q8_0 / Q5_K / Q6_K rows). See ``kernels.vnni_parts``
for why parts rather than one widened layout.
"""

from __future__ import annotations

import torch

from tokenwire.kernels.dispatch import use_triton
from tokenwire.kernels.vnni_matmul import vnni_supported
from tokenwire.kernels.vnni_parts import PartKind, prepare_vnni_parts, vnni_parts_matmul
from tokenwire.kernels.w4a16 import unpack_int4
from tokenwire.runtime.loader.gguf import GGUFInt4, GGUFInt8
from tokenwire.runtime.models.layers.quant.base import LinearLayer, ParamLayout, local_features

KQuantParts = tuple[tuple[int, PartKind], ...]  # (rows, kind) per part, in output order


def kquant_tensors(weight: GGUFInt4 | GGUFInt8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A record as the canonical ``(codes, scales per 16, mins per 32)``."""
    if isinstance(weight, GGUFInt4):
        if weight.group_size != 32:
            raise ValueError(f"int4 group {weight.group_size} is not GGUF's 32")
        scales = weight.scales.t().float()
        mins = -weight.zeros.t().float() * scales  # W = code * scale + min, as the int4 path
        codes = unpack_int4(weight.qweight).t().to(torch.int8)
        return codes.contiguous(), scales.repeat_interleave(2, 1).contiguous(), mins.contiguous()
    spread = {16: 1, 32: 2}.get(weight.group_size, 0)  # scales per 16 inputs
    if not spread:
        raise ValueError(f"int8 group {weight.group_size} is not 16 or 32")
    scales = weight.scales.float().repeat_interleave(spread, 1).contiguous()
    mins = (
        weight.mins
        if weight.mins is not None
        else torch.zeros(weight.out_features, weight.in_features // 32)
    )
    return weight.qweight.contiguous(), scales, mins.float().contiguous()


class GGUFKQuantMethod:
    """Canonical ``qweight`` (int8) / ``scales`` / ``mins`` parameters; VNNI parts or dense."""

    def __init__(self, parts: KQuantParts, *, vnni: bool) -> None:
        self.parts = parts
        self.vnni = vnni
        self.dtype = torch.float32

    @property
    def name(self) -> str:
        return "gguf"

    def create_weights(
        self,
        layer: LinearLayer,
        input_size: int,
        output_size: int,
        dtype: torch.dtype,
        *,
        full_input_size: int,
    ) -> None:
        self.dtype = dtype
        split = input_size != full_input_size
        f32, i8 = torch.float32, torch.int8
        g16 = local_features(input_size, 16, layer.what, "scales", split)
        g32 = local_features(input_size, 32, layer.what, "mins", split)
        layer.register(
            "qweight",
            torch.empty(output_size, input_size, dtype=i8),
            ParamLayout(output_dim=0, input_dim=1, dtype=i8, dummy="bits"),
        )
        layer.register(
            "scales", torch.empty(output_size, g16, dtype=f32),
            ParamLayout(0, 1, 1, 16, dtype=f32, dummy="scale"),
        )  # fmt: skip
        layer.register(
            "mins", torch.empty(output_size, g32, dtype=f32),
            ParamLayout(0, 1, 1, 32, dtype=f32, dummy="scale"),
        )  # fmt: skip

    def _local_parts(self, rows: int) -> KQuantParts:
        """This rank's parts: each split like the layer (tensor parallelism splits N)."""
        total = sum(r for r, _ in self.parts)
        return tuple((r * rows // total, kind) for r, kind in self.parts)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return vnni_parts_matmul(x, layer.prepared("kquant"), bias)

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        codes, scales, mins = layer.param("qweight"), layer.param("scales"), layer.param("mins")
        n, k = codes.shape
        triton = use_triton(codes)  # CUDA, or the interpreter
        vnni = not triton and self.vnni and codes.device.type == "cpu" and vnni_supported(k, 32)
        prepared = prepare_vnni_parts(
            codes.detach(), scales.detach(), mins.detach(), self._local_parts(n),
            vnni=vnni, dtype=self.dtype, triton=triton,
        )  # fmt: skip
        layer.drop("qweight", "scales", "mins")
        layer.hold("kquant", prepared)
        for i, tensor in enumerate(prepared.canonical or ()):
            layer.register_buffer(f"kquant_canonical_{i}", tensor, persistent=False)
        for i, part in enumerate(prepared.parts):  # the weight-byte count sees the parts too
            for field in ("weight", "scales", "mins"):
                tensor = getattr(part, field)
                if tensor is not None:
                    layer.register_buffer(f"kquant_{i}_{field}", tensor, persistent=False)
