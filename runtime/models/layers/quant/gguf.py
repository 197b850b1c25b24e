"""GGUF checkpoints kept quantized: Q4_0/Q4_1/Q4_K linears as int4 (w4a16), Q8_0/Q6_K as int8,
Q5_K and mixed fused layers part by part (``gguf_kquant``).

``runtime.loader.gguf.iter_gguf_weights`` reads a GGUF file into the canonical layouts; here each
decoder linear's record becomes per-parameter tensors (``<layer>.qweight``, ``.scales``,
``.zeros`` for int4; ``.qweight``, ``.scales`` for int8, group 32, no ``g_idx``; ``.qweight``,
``.scales``, ``.mins`` for a part-by-part layer) that ``load_weights`` cuts like GPTQ's
(column-parallel layers split N, row-parallel layers split K and the groups). Scales and zeros
stay float32 (GGUF's fp16 block scales, exact); the kernels cast them once at
``process_weights_after_loading``.

The scheme is per fused layer (``gguf_linear_plan``): Q4_0 / Q4_1 / Q4_K -> ``int4`` (group
32), Q8_0 -> ``int8`` (group 32), Q6_K -> ``int8`` (group 16). A fused q/k/v or gate/up layer
whose parts differ (Q4_K_M's Q4_K q/k beside a Q6_K v), or with a Q5_K part, is kept part by
part (``KQuant``: each part int4 or int8 on the VNNI kernel, ``kernels.vnni_parts``). A layer
of any other type (F16, Q2_K, ...) runs float: its weights are de-quantized
(``iter_gguf_checkpoint``) into an unquantized layer. Embeddings and the LM head are always
de-quantized to float.

On CPU (``vnni``, bf16 compute: the default model's path) int4 runs ``kernels.vnni_matmul``
(else torch's bf16 int4 kernel) for every call, whatever its number of rows, so a row's bits do
not depend on the batch; int8 runs the VNNI kernel's int8 layout with float32 scales per 16
(exact Q8_0 / Q6_K weights) and, without it, a de-quantized copy (torch's int8 kernel takes
per-channel scales only). Measured, a Q4_K_M file of the default model's shape against the
default Q4_1 model: docs/quantization.md.
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
    MethodFor,
    ParamLayout,
    QuantConfig,
    local_features,
)
from tokenwire.runtime.models.layers.quant.gguf_kquant import (
    GGUFKQuantMethod,
    KQuantParts,
    kquant_tensors,
)

GGUFKind = Literal["int4", "int8"]
GROUP = 32  # GGUF Q4_0 / Q4_1 / Q8_0 block size, and Q4_K's sub-block
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip
# GGUF type -> (kept layout, group size); any other type is de-quantized to float.
KEPT_TYPES: dict[str, tuple[GGUFKind, int]] = {
    "Q4_0": ("int4", GROUP),
    "Q4_1": ("int4", GROUP),
    "Q4_K": ("int4", GROUP),
    "Q8_0": ("int8", GROUP),
    "Q6_K": ("int8", 16),
}
# Types a part-by-part layer (``KQuant``) takes, and the kind of each part.
PART_KINDS: dict[str, Literal["int4", "int8"]] = {
    "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q8_0": "int8", "Q6_K": "int8", "Q5_K": "int8",
}  # fmt: skip


@dataclass(frozen=True)
class KQuant:
    """A fused layer kept part by part: ``(rows, kind)`` per part in output order."""

    parts: KQuantParts


# One fused layer's scheme: (kind, group), KQuant, or None when it runs float (de-quantized).
LayerScheme = tuple[GGUFKind, int] | KQuant | None
GGUFPlan = tuple[tuple[str, LayerScheme], ...]  # (fused layer prefix, scheme), file order


def is_linear_weight(name: str) -> bool:
    """Whether HF parameter ``name`` is a decoder linear layer's weight."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _LINEARS


def fused_prefix(name: str) -> str:
    """The model's layer holding HF linear weight ``name`` (q/k/v -> qkv_proj, gate/up ->
    gate_up_proj): ``model.layers.0.self_attn.k_proj.weight`` -> ``...self_attn.qkv_proj``."""
    stem, _, part = name.removesuffix(".weight").rpartition(".")
    return f"{stem}.{_FUSED.get(part, part)}"


def _scheme(parts: dict[str, tuple[int, str]]) -> LayerScheme:
    """One fused layer's scheme from its parts' ``(rows, GGUF type)`` by HF part name."""
    kept = {KEPT_TYPES.get(qtype) for _, qtype in parts.values()}
    if len(kept) == 1 and None not in kept:
        return kept.pop()
    if any(qtype not in PART_KINDS for _, qtype in parts.values()):
        return None
    order = sorted(parts, key=lambda part: _LINEARS.index(part))
    return KQuant(tuple((parts[p][0], PART_KINDS[parts[p][1]]) for p in order))


def gguf_linear_plan(path: Path) -> tuple[GGUFPlan, str]:
    """Each decoder layer's kept scheme, and why some run float ("" when none does).

    A fused layer (q/k/v, gate/up) whose parts share a type's layout and group keeps it; one
    whose parts differ (Q4_K_M stores v, and some down projections, Q6_K beside Q4_K q/k) or
    with a Q5_K part is kept part by part (``KQuant``); a layer with another type runs float."""
    layers: dict[str, dict[str, tuple[int, str]]] = {}
    types: dict[str, set[str]] = {}
    for info in open_gguf(path).tensors:
        name = hf_name(info.name) if info.name not in IGNORED else ""
        if not is_linear_weight(name) or len(info.shape) != 2:
            continue
        qtype = info.ggml_type.name
        part = name.split(".")[-2]
        layers.setdefault(fused_prefix(name), {})[part] = (info.shape[0], qtype)
        types.setdefault(qtype, set()).add(name)
    plan = tuple((prefix, _scheme(parts)) for prefix, parts in layers.items())
    floats = sum(scheme is None for _, scheme in plan)
    if not floats:
        return plan, ""
    kept = ", ".join(sorted(PART_KINDS))
    why = (
        f"{floats} of {len(plan)} decoder linear layers run float: the file's linear weights "
        f"are {', '.join(sorted(types))}; kept quantized are {kept}"
    )
    return plan, why


def iter_gguf_checkpoint(
    path: Path, plan: GGUFPlan | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of a GGUF file for a model built with ``GGUFConfig``: each decoder
    linear record as its canonical per-parameter tensors (float when ``plan`` runs its layer
    float), everything else as float."""
    floats = {prefix for prefix, scheme in plan or () if scheme is None}
    parted = {prefix for prefix, scheme in plan or () if isinstance(scheme, KQuant)}
    for name, weight in iter_gguf_weights(path):
        prefix = name.removesuffix(".weight")
        linear = is_linear_weight(name) and fused_prefix(name) not in floats
        if isinstance(weight, GGUFInt4 | GGUFInt8) and linear and fused_prefix(name) in parted:
            codes, scales, mins = kquant_tensors(weight)
            yield f"{prefix}.qweight", codes
            yield f"{prefix}.scales", scales
            yield f"{prefix}.mins", mins
        elif isinstance(weight, GGUFInt4) and linear:
            yield f"{prefix}.qweight", weight.qweight
            yield f"{prefix}.scales", weight.scales
            yield f"{prefix}.zeros", weight.zeros
        elif isinstance(weight, GGUFInt8) and linear:
            yield f"{prefix}.qweight", weight.qweight
            yield f"{prefix}.scales", weight.scales
        elif isinstance(weight, GGUFInt4 | GGUFInt8):  # embedding, LM head, float layers
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
    # With bfloat16 compute on CPU: the int4 linears run ``kernels.vnni_matmul`` (int8
    # activations) instead of torch's int4 kernel (``--cpu-quant-kernel``, resolved at load).
    vnni: bool = False
    # Per fused layer (``gguf_linear_plan``); empty: every layer ``kind`` with group 32.
    plan: GGUFPlan = ()

    def linear_method(self) -> LinearMethod:
        return GGUFLinearMethod(self.kind, self.compute_dtype, vnni=self.vnni)

    def method_for(self) -> MethodFor:
        if not self.plan:
            return super().method_for()
        methods: dict[LayerScheme, LinearMethod] = {}
        for _, scheme in self.plan:
            if isinstance(scheme, KQuant):
                methods[scheme] = GGUFKQuantMethod(scheme.parts, vnni=self.vnni)
            elif scheme is not None:
                methods[scheme] = GGUFLinearMethod(
                    scheme[0], self.compute_dtype, scheme[1], vnni=self.vnni
                )
        schemes = dict(self.plan)
        return lambda prefix: methods.get(schemes.get(prefix))


class GGUFLinearMethod:
    """Canonical int4 (``qweight/scales/zeros``) or int8 (``qweight/scales``) parameters."""

    def __init__(
        self,
        kind: GGUFKind,
        compute_dtype: torch.dtype | None = None,
        group: int = GROUP,
        *,
        vnni: bool = False,
    ) -> None:
        self.kind = kind
        self.compute_dtype = compute_dtype
        self.vnni = vnni
        self.group = group
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
        groups = local_features(input_size, self.group, layer.what, "scales", split)
        f32 = torch.float32
        if self.kind == "int4":
            rows = local_features(input_size, 8, layer.what, "qweight", split)
            i32 = torch.int32
            layer.register(
                "qweight",
                torch.empty(rows, output_size, dtype=i32),
                ParamLayout(output_dim=1, input_dim=0, input_pack=8, dtype=i32, dummy="bits"),
            )
            grouped = ParamLayout(1, 0, 1, self.group, dtype=f32, dummy="scale")
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
            ParamLayout(0, 1, 1, self.group, dtype=f32, dummy="scale"),
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
                qweight, scales, zeros, None, self.group, device, dtype,
                compute_dtype=self.compute_dtype, vnni=self.vnni,
            )  # fmt: skip
            layer.drop("qweight", "scales", "zeros")
            layer.hold("w4a16", prepared)
            return
        prepared8 = prepare_w8a16(
            qweight, scales, self.group, device, dtype, compute_dtype=self.compute_dtype,
            vnni=self.vnni,
        )  # fmt: skip
        layer.drop("qweight", "scales")
        layer.hold("w8a16", prepared8)
