"""The quantized-linear seam (vLLM's ``LinearMethodBase`` / ``QuantizationConfig`` idea).

A ``LinearMethod`` is one object per weight scheme (unquantized, GPTQ, AWQ, int8, ...). A
linear layer (``LinearLayer``: the tensor-parallel QKV / merged-column / row-parallel
layers) hands it its local sizes; the method

- ``create_weights``: registers the scheme's parameters on the layer, in the checkpoint's own
  layout (GPTQ ``qweight/qzeros/scales/g_idx``, ...), each with a ``ParamLayout`` saying which
  of its dimensions runs along the layer's output (N) and input (K) features and how many
  features one element covers there (8 for an int4-packed dimension, ``group_size`` for the
  group dimension of scales and zeros). The layer turns those layouts into per-rank slices of
  the checkpoint tensors and the offsets of fused q/k/v and gate/up shards, packed or not;
- ``process_weights_after_loading``: converts the loaded tensors once into what ``apply``
  runs (the canonical int4 / int8 layouts of ``kernels.quant_matmul``) and frees the rest;
- ``apply``: ``y = x @ W.T (+ bias)``.

A ``QuantConfig`` is the parsed scheme (from the checkpoint's ``quantization_config`` or
``--quantization``); it hands out the method for the model's linear layers. Embeddings, the
LM head and norms always stay unquantized, as in vLLM. Nothing above the layers (model,
runner) ever branches on a scheme.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import nn

from tokenwire.runtime.models.arch import TP_FLAG

# How a dummy (``--load-format dummy``) run fills a parameter: N(0, std); uniformly random
# bits (packed integer codes); a constant ``std / 4`` (int4 scales: random codes minus random
# zeros stay within +-16, so weights come out O(std)); or not at all (emptied after).
DummyInit = Literal["normal", "bits", "scale", "skip"]


@dataclass(frozen=True)
class ParamLayout:
    """Where a linear layer's parameter runs along the layer's features.

    ``output_dim`` / ``input_dim``: the parameter's dimension along the output (N) / input
    (K) features, None when it does not run along them (a bias has no input dimension; GPTQ's
    ``g_idx`` no output dimension; scales kept whole on every rank, no input dimension).
    ``output_pack`` / ``input_pack``: features per element along that dimension (8 for
    int4 codes packed into int32, ``group_size`` for a per-group tensor).
    ``dtype``: the checkpoint tensor's required dtype (packed integer tensors); ``optional``:
    the checkpoint may omit it (it is then emptied after loading).
    """

    output_dim: int | None = None
    input_dim: int | None = None
    output_pack: int = 1
    input_pack: int = 1
    dtype: torch.dtype | None = None
    optional: bool = False
    dummy: DummyInit = "normal"
    # A per-tensor scale: one element per checkpoint tensor fused into the layer (q, k, v),
    # each checkpoint tensor of this shape (``()`` or ``(1,)``) landing at its shard's index;
    # whole on every rank. None: not such a parameter.
    per_shard: tuple[int, ...] | None = None


class LinearMethod(Protocol):
    """One weight scheme of a linear layer: create its parameters, post-process, apply."""

    @property
    def name(self) -> str:
        """The scheme as ``--quantization`` spells it ("" when unquantized)."""
        ...

    def create_weights(
        self,
        layer: LinearLayer,
        input_size: int,
        output_size: int,
        dtype: torch.dtype,
        *,
        full_input_size: int,
    ) -> None:
        """Register this rank's parameters on ``layer`` (``layer.register``): a weight of
        ``output_size`` x ``input_size`` local features; ``full_input_size`` is the layer's
        unsplit input (larger under row parallelism)."""
        ...

    def apply(
        self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor: ...

    def process_weights_after_loading(self, layer: LinearLayer) -> None: ...


class LinearLayer(nn.Module):
    """A layer whose weight parameters come from a ``LinearMethod`` (set ``linear_method``
    and call ``linear_method.create_weights(self, ...)`` in the subclass constructor)."""

    linear_method: LinearMethod
    what: str = "linear layer"  # names the layer's features in split errors

    def __init__(self) -> None:
        super().__init__()
        self.param_layouts: dict[str, ParamLayout] = {}

    def register(self, name: str, tensor: torch.Tensor, layout: ParamLayout) -> None:
        """Register ``tensor`` as parameter ``name`` with its layout."""
        param = nn.Parameter(tensor, requires_grad=tensor.is_floating_point())
        self.__dict__.pop(name, None)  # a plain ``None`` placeholder (``self.bias = None``)
        self.register_parameter(name, param)
        self.param_layouts[name] = layout

    def param(self, name: str) -> torch.Tensor:
        tensor = self._parameters.get(name)
        if tensor is None:
            raise AttributeError(f"{type(self).__name__} has no parameter {name!r}")
        return tensor

    def has_data(self, name: str) -> bool:
        """Whether parameter ``name`` exists and was not emptied (an optional tensor the
        checkpoint left out is emptied after loading)."""
        tensor = self._parameters.get(name)
        return tensor is not None and tensor.numel() > 0

    def empty(self, name: str) -> None:
        """Replace parameter ``name`` by an empty tensor (an optional tensor not loaded)."""
        old = self.param(name)
        self._parameters[name] = nn.Parameter(
            torch.empty(0, dtype=old.dtype, device=old.device), requires_grad=False
        )

    def drop(self, *names: str) -> None:
        """Remove parameters that post-processing has consumed."""
        for name in names:
            self._parameters.pop(name, None)
            self.param_layouts.pop(name, None)

    def hold(self, name: str, prepared: Any) -> None:
        """Keep ``prepared`` (the kernels' prepared weights) as attribute ``name`` and its
        tensors as non-persistent buffers, so the weight-byte count (parameters + buffers)
        sees them. The model is built on its device and never moved after loading."""
        object.__setattr__(self, name, prepared)
        for field, value in _tensor_fields(prepared):
            self.register_buffer(f"{name}_{field}", value, persistent=False)

    def prepared(self, name: str) -> Any:
        """What ``hold`` kept under ``name``."""
        return self.__dict__[name]


def _tensor_fields(obj: Any) -> list[tuple[str, torch.Tensor]]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif hasattr(obj, "_asdict"):
        items = list(obj._asdict().items())
    else:
        items = list(getattr(obj, "__dict__", {}).items())
    return [(name, value) for name, value in items if isinstance(value, torch.Tensor)]


# A decoder linear layer's method by its HF module prefix (``model.layers.3.self_attn.qkv_proj``);
# None: unquantized.
MethodFor = Callable[[str], "LinearMethod | None"]


def no_quantization(prefix: str) -> LinearMethod | None:
    """The ``MethodFor`` of an unquantized model."""
    return None


class QuantConfig(ABC):
    """A parsed weight scheme; hands out the linear method of the model's linear layers."""

    name: ClassVar[str]

    @abstractmethod
    def linear_method(self) -> LinearMethod: ...

    def method_for(self) -> MethodFor:
        """Each decoder linear's method by its prefix: one shared method unless the scheme
        differs per layer (a GGUF file mixing types)."""
        method = self.linear_method()
        return lambda prefix: method


@torch.no_grad()
def process_weights_after_loading(model: nn.Module) -> None:
    """Run every linear layer's post-load conversion (once, after all weights are in).

    A method's ValueError starts with the parameter at fault (``"qzeros: ..."``); it is
    re-raised with the layer's name in front (``model.layers.0.mlp.down_proj.qzeros: ...``).
    """
    for prefix, module in model.named_modules():
        if isinstance(module, LinearLayer):
            try:
                module.linear_method.process_weights_after_loading(module)
            except ValueError as exc:
                raise ValueError(f"{prefix}.{exc}") from None


@torch.no_grad()
def fill_dummy(
    tensor: torch.Tensor, layout: ParamLayout | None, generator: torch.Generator, std: float
) -> None:
    """Fill ``tensor`` with dummy values of the kind its layout asks for."""
    kind = "normal" if layout is None else layout.dummy
    if kind == "normal":
        tensor.normal_(0.0, std, generator=generator)
    elif kind == "scale":
        tensor.fill_(std / 4)
    elif kind == "bits":
        info = torch.iinfo(tensor.dtype)
        tensor.random_(info.min, info.max, generator=generator)
    # "skip": an optional tensor the dummy run leaves out


def config_key(key: str) -> str:
    """How errors name a key of config.json's ``quantization_config``."""
    return f"config.json quantization_config.{key}"


def config_value(
    qc: Mapping[str, Any], key: str, default: Any, allowed: tuple[Any, ...] | None = None
) -> Any:
    """``qc[key]`` (``default`` when absent or null); a value outside ``allowed`` is a
    ValueError naming the key."""
    value = qc.get(key)
    if value is None:
        value = default
    if allowed is not None and value not in allowed:
        options = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{config_key(key)}={value!r} is not supported (supported: {options})")
    return value


def local_features(size: int, per: int, what: str, tensor: str, split: bool) -> int:
    """``size // per`` for ``size`` local features of ``what`` and ``per`` features per row
    of ``tensor`` (a pack or a group); not a whole number of rows is a ValueError, naming
    ``--tensor-parallel-size`` when tensor parallelism (``split``) made the share."""
    if size % per == 0:
        return size // per
    if split:
        raise ValueError(
            f"{TP_FLAG} gives each rank {size} features of the {what}, not a multiple of the "
            f"{per} features per row of the quantized {tensor}: choose a tensor-parallel size "
            "that keeps every rank's share a multiple of it"
        )
    raise ValueError(
        f"the {what} has {size} features, not a multiple of the {per} features per row of "
        f"the quantized {tensor}"
    )
