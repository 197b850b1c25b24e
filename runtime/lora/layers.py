"""Linear layers with stacked LoRA adapter slots (vLLM's ``*WithLoRA`` layers).

Each wrapper keeps its base layer (any weight scheme: the LoRA delta is added to whatever
the base's ``LinearMethod`` computes) and, per adapter slot ``s`` of ``max_loras``:

- ``lora_a[s]``: [n * R, K] — the A matrices of the ``n`` projections fused in the base
  layer (q, k, v or gate, up), each zero-padded to the max rank ``R``;
- ``lora_b[s]``: [N_local, n * R] — block diagonal: projection ``i``'s B (this rank's output
  rows of it, scaling folded in) in columns ``i*R .. i*R + r``, zero elsewhere.

So a fused layer needs one shrink and one expand per step whatever it fuses; the zeros add
exact zeros. ``kernels.lora.add_lora`` runs both over the step's runs of tokens that share an
adapter (``LoRAContext.segments``, set by the ``LoRAManager`` before each forward).

Tensor parallelism: a column-parallel layer sees the whole input, so A is whole and B holds
this rank's output rows. A row-parallel layer sees this rank's input features, so A holds
those columns and B is whole; the local delta is added to the partial product *before* the
all-reduce, which sums the ranks' partial deltas exactly as it sums the base's: no extra
collective.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenwire.kernels.lora import LoRASegments, add_lora
from tokenwire.runtime.models.layers.parallel import RowParallelLinear, _ColumnLinear

# One projection's adapter weights, full (unsplit) tensors: A [r, in], B [out, r] (scaled).
ProjectionLoRA = tuple[torch.Tensor, torch.Tensor]


class LoRAContext:
    """The step's token runs per adapter slot, shared by every LoRA layer of one model
    (None: no token of this step uses an adapter, the layers run their base only)."""

    def __init__(self) -> None:
        self.segments: LoRASegments | None = None


class _SlotsMixin(nn.Module):
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def _allocate(
        self,
        max_loras: int,
        rows_a: int,
        in_f: int,
        out_f: int,
        dtype: torch.dtype,
        base: nn.Module,
    ) -> None:
        device = _device_of(base)
        a = torch.zeros(max_loras, rows_a, in_f, dtype=dtype, device=device)
        b = torch.zeros(max_loras, out_f, rows_a, dtype=dtype, device=device)
        self.register_buffer("lora_a", a, persistent=False)
        self.register_buffer("lora_b", b, persistent=False)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()


def _device_of(layer: nn.Module) -> torch.device:
    for param in layer.parameters():
        return param.device
    for buffer in layer.buffers():
        return buffer.device
    raise ValueError(f"{type(layer).__name__} holds no tensor to place LoRA slots by")


class ColumnLinearWithLoRA(_SlotsMixin):
    """A column-parallel layer (``QKVParallelLinear``, ``MergedColumnParallelLinear``) whose
    fused outputs are the projections ``modules`` (HF names, in the base's shard order)."""

    def __init__(
        self,
        base: _ColumnLinear,
        modules: tuple[str, ...],
        in_features: int,
        max_loras: int,
        max_rank: int,
        context: LoRAContext,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if len(modules) != len(base.output_shards):
            raise ValueError(f"{len(modules)} module names for {len(base.output_shards)} shards")
        self.base = base
        self.modules_fused = modules
        self.max_rank = max_rank
        self.context = context
        out_local = sum(s.length for s in base.output_shards)
        self._allocate(max_loras, len(modules) * max_rank, in_features, out_local, dtype, base)

    def set_slot(self, slot: int, weights: dict[str, ProjectionLoRA]) -> None:
        self.clear_slot(slot)
        r_max = self.max_rank
        for i, (module, shard) in enumerate(
            zip(self.modules_fused, self.base.output_shards, strict=True)
        ):
            if module not in weights:
                continue
            a, b = weights[module]
            r = a.shape[0]
            self.lora_a[slot, i * r_max : i * r_max + r].copy_(a)
            rows = b[shard.start : shard.start + shard.length]
            self.lora_b[
                slot, shard.offset : shard.offset + shard.length, i * r_max : i * r_max + r
            ].copy_(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        segments = self.context.segments
        if segments is not None:
            add_lora(y, x, self.lora_a, self.lora_b, segments)
        return y


class RowLinearWithLoRA(_SlotsMixin):
    """A ``RowParallelLinear`` (``o_proj``, ``down_proj``) with adapter slots."""

    def __init__(
        self,
        base: RowParallelLinear,
        module: str,
        max_loras: int,
        max_rank: int,
        context: LoRAContext,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.base = base
        self.module = module
        self.context = context
        self._allocate(max_loras, max_rank, base.input_size, base.out_features, dtype, base)

    def set_slot(self, slot: int, weights: dict[str, ProjectionLoRA]) -> None:
        self.clear_slot(slot)
        if self.module not in weights:
            return
        a, b = weights[self.module]
        r = a.shape[0]
        start, size = self.base.input_start, self.base.input_size
        self.lora_a[slot, :r].copy_(a[:, start : start + size])
        self.lora_b[slot, :, :r].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        segments = self.context.segments
        base = self.base
        if segments is None:
            out: torch.Tensor = base(x)
            return out
        if base.tp.world_size == 1:
            y: torch.Tensor = base(x)
            add_lora(y, x, self.lora_a, self.lora_b, segments)
            return y
        partial = base.linear_method.apply(base, x, None)
        add_lora(partial, x, self.lora_a, self.lora_b, segments)  # summed by the all-reduce
        y = base.tp.all_reduce(partial)
        if base.bias is not None:
            y.add_(base.bias)
        return y
