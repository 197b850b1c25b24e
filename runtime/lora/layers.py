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

from tokenwire.kernels.lora import LoRASegments, add_lora, add_lora_masked, slot_mask
from tokenwire.runtime.models.layers.parallel import RowParallelLinear, _ColumnLinear

# One projection's adapter weights, full (unsplit) tensors: A [r, in], B [out, r] (scaled).
ProjectionLoRA = tuple[torch.Tensor, torch.Tensor]


class LoRAContext:
    """The step's token runs per adapter slot, shared by every LoRA layer of one model
    (None: no token of this step uses an adapter, the layers run their base only).

    On CPU with several runs, ``token_slots`` is set too and the layers take the masked
    all-slots path (``add_lora_masked``: two matmuls per layer instead of two per run); the
    masks are built once per step per rank-column width."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.segments: LoRASegments | None = None
        self.token_slots: torch.Tensor | None = None
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def set(self, segments: LoRASegments | None, token_slots: torch.Tensor | None) -> None:
        self.segments, self.token_slots = segments, token_slots
        self._masks.clear()

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        assert self.token_slots is not None
        key = (width, dtype)
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = slot_mask(self.token_slots, self.num_slots, width, dtype)
        return mask

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: _SlotsMixin) -> None:
        """``y += LoRA(x)`` for this step's tokens, by whichever path the step uses."""
        if self.token_slots is not None:
            n, s, w = layer.lora_b_nsr.shape
            a_flat = layer.lora_a.view(s * w, -1)
            add_lora_masked(y, x, a_flat, layer.lora_b_nsr.view(n, s * w), self.mask(w, y.dtype))
        elif self.segments is not None:
            add_lora(y, x, layer.lora_a, layer.lora_b, self.segments)


class _SlotsMixin(nn.Module):
    lora_a: torch.Tensor  # [S, W, K]
    lora_b_nsr: torch.Tensor  # [N, S, W]: ``lora_b`` is its [S, N, W] view

    @property
    def lora_b(self) -> torch.Tensor:
        """[S, N, W] (a strided view: the masked CPU path reads B as [N, S*W])."""
        return self.lora_b_nsr.permute(1, 0, 2)

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
        b = torch.zeros(out_f, max_loras, rows_a, dtype=dtype, device=device)
        self.register_buffer("lora_a", a, persistent=False)
        self.register_buffer("lora_b_nsr", b, persistent=False)

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
        if self.context.segments is not None:
            self.context.apply(y, x, self)
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
            self.context.apply(y, x, self)
            return y
        partial = base.linear_method.apply(base, x, None)
        self.context.apply(partial, x, self)  # summed by the all-reduce
        y = base.tp.all_reduce(partial)
        if base.bias is not None:
            y.add_(base.bias)
        return y
