"""GGUF checkpoints kept quantized: Q4_0 / Q4_1 linears as int4 (w4a16), Q8_0 as int8 (w8a16).

``runtime.loader.gguf.iter_gguf_weights`` reads a GGUF file into the canonical layouts; here each
decoder linear's record becomes per-parameter tensors (``<layer>.qweight``, ``.scales``,
``.zeros`` for int4; ``.qweight``, ``.scales`` for int8, group 32, no ``g_idx``) that
``load_weights`` cuts like GPTQ's (column-parallel layers split N, row-parallel layers split
K and the groups). Scales and zeros stay float32 (GGUF's fp16 block scales, exact); the
kernels cast them once at ``process_weights_after_loading``.

One scheme per model (``gguf_linear_kind``): every decoder linear Q4_0/Q4_1 -> ``int4``,
every one Q8_0 -> ``int8``. A file whose linears mix those (a fused q/k/v or gate/up would
mix types) or use any other type (Q4_K, Q6_K, F16, ...) has no kept-quantized plan; the
loader then de-quantizes the whole model to float, as before, and logs why. Embeddings and
the LM head are always de-quantized to float (a Q8_0 tied embedding included).

On CPU int4 runs torch's bf16 int4 kernel for every call, whatever its number of rows, so a
row's bits do not depend on the batch (``w4a16``; a bf16 de-quantized copy for calls of more
than 4 rows was faster there but rounded differently, defects #20); Q8_0's per-block scales
are not what torch's int8 kernel takes (per channel), so an int8 layer runs a dequantized
copy there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch

from tokenwire.kernels.quant_matmul import (
    prepare_w4a16,
    prepare_w8a16,
    w4a16_matmul,
    w8a16_matmul,
)
from tokenwire.runtime.loader.gguf import GGUFInt4, GGUFInt8, iter_gguf_weights
from tokenwire.runtime.loader.gguf.container import open_gguf
from tokenwire.runtime.loader.gguf.names import IGNORED, hf_name
from tokenwire.runtime.models.layers.quant.base import (
    LinearLayer,
    LinearMethod,
    ParamLayout,
    QuantConfig,
    local_features,
)

GGUFKind = Literal["int4", "int8"]
GROUP = 32  # GGUF Q4_0 / Q4_1 / Q8_0 block size
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KIND_OF_TYPE: dict[str, GGUFKind] = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}


def is_linear_weight(name: str) -> bool:
    """Whether HF parameter ``name`` is a decoder linear layer's weight."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _LINEARS


def gguf_linear_kind(path: Path) -> tuple[GGUFKind | None, str]:
    """(the kept-quantized scheme of the file's decoder linears or None, why not)."""
    types: dict[str, set[str]] = {}
    for info in open_gguf(path).tensors:
        if info.name in IGNORED:
            continue
        name = hf_name(info.name)
        if is_linear_weight(name) and len(info.shape) == 2:
            types.setdefault(info.ggml_type.name, set()).add(name)
    kinds = {_KIND_OF_TYPE.get(t) for t in types}
    if len(kinds) == 1 and None not in kinds:
        kind = kinds.pop()
        assert kind is not None
        return kind, ""
    if not types:
        return None, "it has no decoder linear weights"
    return None, (
        f"its decoder linear weights are {', '.join(sorted(types))}; kept quantized are only "
        "all Q4_0/Q4_1 (int4) or all Q8_0 (int8)"
    )


def iter_gguf_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of a GGUF file for a model built with ``GGUFConfig``: each decoder
    linear record as its canonical per-parameter tensors, everything else as float."""
    for name, weight in iter_gguf_weights(path):
        prefix = name.removesuffix(".weight")
        if isinstance(weight, GGUFInt4) and is_linear_weight(name):
            yield f"{prefix}.qweight", weight.qweight
            yield f"{prefix}.scales", weight.scales
            yield f"{prefix}.zeros", weight.zeros
        elif isinstance(weight, GGUFInt8) and is_linear_weight(name):
            yield f"{prefix}.qweight", weight.qweight
            yield f"{prefix}.scales", weight.scales
        elif isinstance(weight, GGUFInt4 | GGUFInt8):  # embedding / LM head: float
            yield name, weight.dequantize()
        else:
            yield name, weight


@dataclass(frozen=True)
class GGUFConfig(QuantConfig):
    name: ClassVar[str] = "gguf"
    kind: GGUFKind = "int4"
    # The matmuls' dtype when it differs from the model's: bfloat16 lets a float32 model run
    # torch's int4 CPU kernel (activations cast per call; not exact). None: the model dtype.
    compute_dtype: torch.dtype | None = None

    def linear_method(self) -> LinearMethod:
        return GGUFLinearMethod(self.kind, self.compute_dtype)


class GGUFLinearMethod:
    """Canonical int4 (``qweight/scales/zeros``) or int8 (``qweight/scales``) parameters."""

    def __init__(self, kind: GGUFKind, compute_dtype: torch.dtype | None = None) -> None:
        self.kind = kind
        self.compute_dtype = compute_dtype
        self.dtype = torch.float32  # the model dtype, set by create_weights

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
        groups = local_features(input_size, GROUP, layer.what, "scales", split)
        f32 = torch.float32
        if self.kind == "int4":
            rows = local_features(input_size, 8, layer.what, "qweight", split)
            i32 = torch.int32
            layer.register(
                "qweight",
                torch.empty(rows, output_size, dtype=i32),
                ParamLayout(output_dim=1, input_dim=0, input_pack=8, dtype=i32, dummy="bits"),
            )
            grouped = ParamLayout(1, 0, 1, GROUP, dtype=f32, dummy="scale")
            layer.register("scales", torch.empty(groups, output_size, dtype=f32), grouped)
            layer.register("zeros", torch.empty(groups, output_size, dtype=f32), grouped)
            return
        i8 = torch.int8
        layer.register(
            "qweight",
            torch.empty(output_size, input_size, dtype=i8),
            ParamLayout(output_dim=0, input_dim=1, dtype=i8, dummy="bits"),
        )
        layer.register(
            "scales",
            torch.empty(output_size, groups, dtype=f32),
            ParamLayout(0, 1, 1, GROUP, dtype=f32, dummy="scale"),
        )

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "int4":
            return w4a16_matmul(x, layer.prepared("w4a16"), bias)
        return w8a16_matmul(x, layer.prepared("w8a16"), bias)

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        qweight, scales = layer.param("qweight"), layer.param("scales")
        device, dtype = qweight.device, self.dtype
        if self.kind == "int4":
            zeros = layer.param("zeros")
            prepared = prepare_w4a16(
                qweight, scales, zeros, None, GROUP, device, dtype,
                compute_dtype=self.compute_dtype,
            )  # fmt: skip
            layer.drop("qweight", "scales", "zeros")
            layer.hold("w4a16", prepared)
            return
        prepared8 = prepare_w8a16(
            qweight, scales, GROUP, device, dtype, compute_dtype=self.compute_dtype
        )
        layer.drop("qweight", "scales")
        layer.hold("w8a16", prepared8)
