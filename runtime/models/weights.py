"""Lazy checkpoint weights and how one rank's parameter takes its slice of them.

A ``WeightSource`` is a checkpoint tensor not yet read: its ``shape`` is known, and the loader
reads either the whole tensor or a contiguous range along one dimension. A safetensors source
reads through ``safe_open(...).get_slice(name)``, so a tensor-parallel rank touches only the
bytes of its own slice (the file is memory-mapped; nothing else is copied).

A ``ShardLoad`` says where one checkpoint tensor lands in a local parameter: the tensor's full
(TP=1) shape, the dimension this rank reads a range of (None: the whole tensor, replicated),
that range, and the offset inside a fused local parameter (q/k/v, gate/up) along the
destination dimension (dim 0 for ``[out, in]`` weights; the packed output dimension of a
quantized tensor, e.g. dim 1 of GPTQ's ``qweight [K/8, N]``). A range that runs past the end
of the checkpoint tensor (a vocabulary padded up to a multiple of the TP size) is
zero-filled. ``dtype`` (packed quantized tensors) is the only dtype the checkpoint tensor may
have; ``shared`` marks a tensor that every shard of a fused layer provides whole (GPTQ's
``g_idx``: q, k and v read the same input, so their copies must be equal). ``dst_index``
selects one entry along dim 0 of a stacked parameter first (a MoE layer's experts, stacked
``[E, ...]``: expert ``e``'s checkpoint tensor lands in ``param[e]``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Protocol

import torch


class WeightSource(Protocol):
    """A checkpoint tensor that has not been read yet."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self) -> torch.Tensor:
        """The whole tensor (CPU)."""
        ...

    def read_slice(self, dim: int, start: int, length: int) -> torch.Tensor:
        """``tensor.narrow(dim, start, length)``, reading only those elements (CPU)."""
        ...


class TensorWeight:
    """A tensor already in memory (tests, converted weights, dummy initialisation)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self) -> torch.Tensor:
        return self.tensor

    def read_slice(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.tensor.narrow(dim, start, length)


class SafetensorsWeight:
    """Tensor ``name`` of an open safetensors file (``safe_open`` handle), read lazily.

    ``read`` is ``get_tensor``; ``read_slice`` goes through ``get_slice``, which reads only the
    requested range of the memory-mapped file. Valid while the handle is open
    (``iter_safetensors`` keeps it open until the iteration moves on to the next file).
    """

    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle
        self._name = name
        self._shape = tuple(int(n) for n in handle.get_slice(name).get_shape())

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def read(self) -> torch.Tensor:
        tensor: torch.Tensor = self._handle.get_tensor(self._name)
        return tensor

    def read_slice(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self._shape)
        index[dim] = slice(start, start + length)
        tensor: torch.Tensor = self._handle.get_slice(self._name)[tuple(index)]
        return tensor


def as_weight_source(weight: torch.Tensor | WeightSource) -> WeightSource:
    return TensorWeight(weight) if isinstance(weight, torch.Tensor) else weight


@dataclass(frozen=True)
class ShardLoad:
    """Where one checkpoint tensor goes in a (local, possibly fused) parameter."""

    full_shape: tuple[int, ...]  # the checkpoint tensor's shape (what TP=1 holds)
    split_dim: int | None = None  # checkpoint dim this rank reads a range of; None: all of it
    start: int = 0  # first index of the range along ``split_dim``
    length: int = 0  # range length; may run past the checkpoint's end (zero-filled)
    dst_offset: int = 0  # first index of this shard along ``dst_dim`` of the local parameter
    dst_dim: int = 0  # the local parameter's dimension the fused shards are stacked along
    dtype: torch.dtype | None = None  # the checkpoint tensor's required dtype (None: any)
    shared: bool = False  # every shard of a fused layer provides this whole tensor (equal)
    dst_index: int | None = None  # stacked parameter (experts): the tensor lands in param[i]

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.split_dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.split_dim] = self.length
        return tuple(shape)

    @property
    def is_split(self) -> bool:
        return self.split_dim is not None and self.local_shape != self.full_shape


def replicated(
    shape: tuple[int, ...] | torch.Size,
    dst_offset: int = 0,
    *,
    dtype: torch.dtype | None = None,
    shared: bool = False,
) -> ShardLoad:
    """Every rank holds the whole checkpoint tensor."""
    return ShardLoad(tuple(shape), dst_offset=dst_offset, dtype=dtype, shared=shared)


def split(
    full_shape: tuple[int, ...],
    dim: int,
    start: int,
    length: int,
    dst_offset: int = 0,
    *,
    dst_dim: int = 0,
    dtype: torch.dtype | None = None,
    dst_index: int | None = None,
) -> ShardLoad:
    """This rank holds ``[start, start + length)`` of the checkpoint tensor along ``dim``."""
    return ShardLoad(
        tuple(full_shape), dim, start, length, dst_offset, dst_dim, dtype, dst_index=dst_index
    )


def _checked(tensor: torch.Tensor, spec: ShardLoad, label: str) -> torch.Tensor:
    if spec.dtype is not None and tensor.dtype != spec.dtype:
        want = str(spec.dtype).removeprefix("torch.")
        got = str(tensor.dtype).removeprefix("torch.")
        raise ValueError(f"dtype mismatch for {label}: checkpoint {got}, expected {want}")
    return tensor


@torch.no_grad()
def load_shard(
    param: torch.Tensor, spec: ShardLoad, source: WeightSource, label: str, *, compare: bool = False
) -> None:
    """Copy this rank's part of ``source`` into ``param``; ``label`` names it in errors.

    ``compare``: the destination already holds this tensor (a ``shared`` one from another
    shard); check that ``source`` equals it instead of copying."""
    if tuple(source.shape) != spec.full_shape:
        raise ValueError(
            f"shape mismatch for {label}: checkpoint {tuple(source.shape)}, model {spec.full_shape}"
        )
    local = spec.local_shape
    if spec.dst_index is not None:
        param = param[spec.dst_index]
    if param.dim() and not local:  # a scalar into one element (a per-tensor scale)
        target = param[spec.dst_offset]
    elif param.dim():
        target = param.narrow(spec.dst_dim, spec.dst_offset, local[spec.dst_dim])
    else:
        target = param
    assert tuple(target.shape) == local, (label, tuple(target.shape), local)
    dim = spec.split_dim
    if dim is None or not spec.is_split:
        tensor = _checked(source.read(), spec, label)
        if compare and not torch.equal(target, tensor.to(target.device, target.dtype)):
            raise ValueError(f"{label} differs between the projections fused into one matmul")
        if not compare:
            target.copy_(tensor)
        return
    available = max(0, min(spec.length, spec.full_shape[dim] - spec.start))
    if available:
        part = _checked(source.read_slice(dim, spec.start, available), spec, label)
        target.narrow(dim, 0, available).copy_(part)
    if available < spec.length:  # padding past the checkpoint's end
        target.narrow(dim, available, spec.length - available).zero_()


@torch.no_grad()
def fill_sharded(
    param: torch.Tensor,
    name: str,
    shards: dict[str, ShardLoad],
    fill: Callable[[torch.Tensor], None],
) -> None:
    """Build the TP=1 (fused) tensor of ``param`` with ``fill`` and load this rank's slices
    of it: a TP=N rank then holds exactly what TP=1 draws from the same random stream."""
    specs = list(shards.values())
    first = specs[0]
    if first.shared:  # one whole tensor that every shard provides
        full = torch.empty(first.full_shape, dtype=param.dtype, device=param.device)
        fill(full)
        load_shard(param, first, TensorWeight(full), name)
        return
    dim = first.dst_dim
    sizes = [spec.full_shape[dim] for spec in specs]
    full_shape = list(first.full_shape)
    full_shape[dim] = sum(sizes)
    full = torch.empty(full_shape, dtype=param.dtype, device=param.device)
    fill(full)
    for (shard, spec), end, count in zip(shards.items(), accumulate(sizes), sizes, strict=True):
        part = TensorWeight(full.narrow(dim, end - count, count))
        load_shard(param, spec, part, f"{name}[{shard or 'all'}]")
