"""Checkpoints that store q/k/v and gate/up fused (Phi-3): split them into HF's per-projection
names so the usual loader puts each part into its shard of ``qkv_proj`` / ``gate_up_proj``.

``qkv_proj.weight`` is ``[q_size + 2 * kv_size, hidden]`` (q rows, then k, then v) and
``gate_up_proj.weight`` is ``[2 * intermediate, hidden]`` (gate rows, then up), as HF's
``Phi3Attention`` and ``Phi3MLP`` slice them. Each part is a lazy ``NarrowedWeight`` over the
checkpoint tensor: a tensor-parallel rank still reads only the rows of its own heads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.weights import WeightSource, as_weight_source

_SPLITTABLE = ("weight", "bias")  # unquantized tensors whose dim 0 is the output feature


class NarrowedWeight:
    """``[start, start + length)`` along ``dim`` of a lazy checkpoint tensor."""

    def __init__(self, base: WeightSource, dim: int, start: int, length: int) -> None:
        self._base = base
        self._dim = dim
        self._start = start
        self._length = length

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self._base.shape)
        shape[self._dim] = self._length
        return tuple(shape)

    def read(self) -> torch.Tensor:
        return self._base.read_slice(self._dim, self._start, self._length)

    def read_slice(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == self._dim:
            return self._base.read_slice(dim, self._start + start, length)
        return self.read().narrow(dim, start, length)


def fused_parts(arch: ModelArch) -> dict[str, tuple[tuple[str, int], ...]]:
    """Fused checkpoint projection -> (HF projection, rows) in storage order (full model)."""
    inter = arch.intermediate_size
    return {
        "qkv_proj": (("q_proj", arch.q_size), ("k_proj", arch.kv_size), ("v_proj", arch.kv_size)),
        "gate_up_proj": (("gate_proj", inter), ("up_proj", inter)),
    }


def split_fused_projections(
    weights: Iterable[tuple[str, torch.Tensor | WeightSource]], arch: ModelArch
) -> Iterator[tuple[str, torch.Tensor | WeightSource]]:
    """Yield ``weights`` with each fused ``qkv_proj`` / ``gate_up_proj`` tensor replaced by
    its parts under the per-projection names. Raises ValueError naming the tensor when its
    rows do not add up or it is not a plain weight/bias (quantized fused tensors)."""
    parts = fused_parts(arch)
    for name, weight in weights:
        fused = next((f for f in parts if f".{f}." in name), None)
        if fused is None:
            yield name, weight
            continue
        suffix = name.rpartition(".")[2]
        if suffix not in _SPLITTABLE:
            raise ValueError(
                f"cannot split fused checkpoint tensor {name!r}: only unquantized "
                f"{'/'.join(_SPLITTABLE)} tensors of {fused} are supported"
            )
        source = as_weight_source(weight)
        rows = sum(size for _, size in parts[fused])
        if not source.shape or source.shape[0] != rows:
            raise ValueError(
                f"shape mismatch for {name}: checkpoint {tuple(source.shape)}, "
                f"expected {rows} rows ({' + '.join(str(s) for _, s in parts[fused])})"
            )
        offset = 0
        for part, size in parts[fused]:
            yield name.replace(f".{fused}.", f".{part}."), NarrowedWeight(source, 0, offset, size)
            offset += size
