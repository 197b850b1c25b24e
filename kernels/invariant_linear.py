"""A float32 CPU linear whose output rows get the same bits whatever the number of rows.

The LM head (``runtime.models.layers.parallel.vocab_parallel_logits``) runs on the rows that
need logits this step, so its row count is the batch's. MKL's float32 GEMM behind ``F.linear``
picks its kernel by the row count M and each kernel rounds a row differently: on SmolLM2's
tied LM head (torch 2.13, AVX-512) M = 1 (a GEMV), M = 2..15 and M >= 16 are three classes,
so greedy output depended on the batch (defects #20). oneDNN's matmul on a weight reordered
once into its blocked layout runs one kernel for every M: the layout fixes each output's
reduction order over K. Measured on that LM head: bit-identical rows for M = 1..300 at any
position, 1, 2 and 8 threads (``tests/kernels/test_defects_invariant.py`` checks it on the
real model); one row costs about what MKL's GEMV does, 16-64 rows about 1.5x less than MKL.

Elsewhere (CUDA, other dtypes, a torch build without oneDNN) ``invariant_linear`` is
``F.linear`` (bf16 ``F.linear`` on CPU already is oneDNN's; CUDA batch invariance is not
claimed). The reordered copy is extra memory: one more copy of the weight; an in-place edit
of the weight makes it stale (``is_current``: the owner reorders again; an inference tensor
keeps no version counter, so its edits go unseen).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Rows per oneDNN call: the range the invariance was measured over; larger calls are split
# (a 256-row call is compute-bound, so the split costs nothing measurable).
_MAX_ROWS = 256


@dataclass(frozen=True)
class InvariantLinearWeight:
    """``weight`` [N, K] and, on CPU float32 with oneDNN, its reordered copy ``packed``
    (made when ``weight`` was at in-place version ``version``)."""

    weight: torch.Tensor
    packed: torch.Tensor | None
    version: int = 0

    def is_current(self, weight: torch.Tensor) -> bool:
        """Whether this was prepared from ``weight`` as it is now (not edited in place since)."""
        same = weight.data_ptr() == self.weight.data_ptr()
        return same and _version(weight) == self.version


def prepare_invariant_linear(weight: torch.Tensor) -> InvariantLinearWeight:
    """Reorder ``weight`` once for ``invariant_linear`` (no copy where it is ``F.linear``)."""
    weight = weight.detach()
    usable = (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )
    if not usable:
        return InvariantLinearWeight(weight, None, _version(weight))
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    return InvariantLinearWeight(weight, packed, _version(weight))


def invariant_linear(x: torch.Tensor, w: InvariantLinearWeight) -> torch.Tensor:
    """``x [M, K] @ weight.T -> [M, N]``; on the reordered weight each row's bits depend only
    on that row."""
    unusable = x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[0] == 0
    if w.packed is None or unusable:
        return F.linear(x, w.weight)
    x = x.contiguous()
    if x.shape[0] <= _MAX_ROWS:
        return _onednn_linear(x, w.packed)
    parts = [_onednn_linear(part, w.packed) for part in x.split(_MAX_ROWS)]
    return torch.cat(parts)


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place version; -1 for an inference tensor (it keeps no version counter)."""
    return -1 if t.is_inference() else t._version


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return out
