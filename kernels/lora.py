"""Batched multi-LoRA matmul (Punica / S-LoRA "segmented gather-BMM"): torch reference,
segment builder and dispatch.

A step has ``T`` tokens (rows of ``x``); token ``t`` is served by adapter slot
``slot(t) in [0, S)`` or by none (``-1``). Slot ``s`` holds ``lora_a[s]: [R, K]`` and
``lora_b[s]: [N, R]`` (``R`` = the largest rank, lower ranks zero-padded; the LoRA scaling is
folded into ``lora_b``). ``add_lora`` adds, in place,

    y[t] += (x[t] @ lora_a[slot(t)].T) @ lora_b[slot(t)].T      for every t with slot(t) >= 0.

The runner orders rows so that each adapter's tokens form a few contiguous *runs*;
``find_runs`` finds them on the host and ``SegmentBuffers.fill`` writes them into persistent
device tensors (``starts``/``lengths``/``slots`` of a fixed size ``max_segments``, unused
entries of length 0), so a CUDA graph captured once replays with each step's runs.

How the Triton grid covers the runs (``lora_triton``): axis 1 is the segment index, always
``max_segments`` wide; axis 0 enumerates ``cdiv(T, BLOCK_M)`` row blocks times the output
column blocks. A program reads its segment's length from the device and returns at once when
the segment is unused (length 0) or its row block starts past the run's end, so a run of
``L`` tokens is covered by its first ``cdiv(L, BLOCK_M)`` row blocks (no run is longer than
``T``). Nothing in the launch depends on the host-known runs: the grid is a function of
``T``, the shapes and ``max_segments`` only. The torch reference loops over the host copy
``segments.runs`` instead (one matmul pair per run).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenwire.kernels.dispatch import use_triton


@dataclass(frozen=True, slots=True)
class LoRASegments:
    """Runs of consecutive tokens served by one adapter slot (slot >= 0 only)."""

    starts: torch.Tensor  # int32 [max_segments] on the device: first token of run i
    lengths: torch.Tensor  # int32 [max_segments]: tokens in run i (0: unused entry)
    slots: torch.Tensor  # int32 [max_segments]: adapter slot of run i
    runs: tuple[tuple[int, int, int], ...]  # host copy (start, length, slot) of the used runs
    num_tokens: int  # T


def find_runs(token_slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, length, slot) of maximal runs of equal slot >= 0 (runs of -1 are skipped)."""
    slots = np.asarray(token_slots).reshape(-1)
    if slots.size == 0:
        return []
    bounds = np.flatnonzero(slots[1:] != slots[:-1]) + 1
    starts = np.concatenate(([0], bounds))
    ends = np.concatenate((bounds, [slots.size]))
    run_slots = slots[starts]
    keep = run_slots >= 0
    return [
        (int(s), int(e - s), int(slot))
        for s, e, slot in zip(starts[keep], ends[keep], run_slots[keep], strict=True)
    ]


class SegmentBuffers:
    """Persistent device tensors (starts/lengths/slots of size max_segments) that `fill` rewrites
    in place each step, so a captured CUDA graph sees the new step's runs; raises ValueError if
    there are more runs than max_segments."""

    def __init__(self, max_segments: int, device: torch.device) -> None:
        if max_segments < 1:
            raise ValueError(f"max_segments must be >= 1, got {max_segments}")
        self.max_segments = max_segments
        # One [3, max_segments] tensor: a step's runs reach the device in a single copy.
        self._table = torch.zeros((3, max_segments), dtype=torch.int32, device=device)
        self.starts, self.lengths, self.slots = self._table.unbind(0)

    def fill(self, token_slots: np.ndarray) -> LoRASegments:
        """Write ``token_slots``' runs (unused entries: length 0) and describe them."""
        runs = find_runs(token_slots)
        if len(runs) > self.max_segments:
            raise ValueError(
                f"{len(runs)} LoRA runs in one step, more than max_segments="
                f"{self.max_segments}: order the rows by adapter or raise max_segments"
            )
        host = np.zeros((3, self.max_segments), dtype=np.int32)
        if runs:
            host[:, : len(runs)] = np.asarray(runs, dtype=np.int32).T
        # A fresh host array each step: the copy never reads a buffer the next step rewrites.
        self._table.copy_(torch.from_numpy(host))
        return self.segments(int(np.asarray(token_slots).size), tuple(runs))

    def clear(self) -> None:
        """Mark every entry unused (length 0): a graph replayed now adds no LoRA delta."""
        self._table.zero_()

    def segments(
        self, num_tokens: int, runs: tuple[tuple[int, int, int], ...] = ()
    ) -> LoRASegments:
        """The buffers seen as the segments of a ``num_tokens``-row step. With ``runs`` left
        empty this is what a CUDA graph of ``num_tokens`` rows captures: the device tensors
        only, whatever ``fill`` or ``clear`` later writes into them."""
        return LoRASegments(
            starts=self.starts,
            lengths=self.lengths,
            slots=self.slots,
            runs=runs,
            num_tokens=num_tokens,
        )


def check_lora_shapes(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: LoRASegments,
) -> None:
    """Raise ValueError unless the operands fit ``y [T, N], x [T, K], lora_a [S, R, K],
    lora_b [S, N, R]`` of one float dtype (host-side metadata only: no device sync)."""
    if y.dim() != 2 or x.dim() != 2 or lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError(
            "add_lora: expected y [T, N], x [T, K], lora_a [S, R, K], lora_b [S, N, R]"
        )
    t, n = y.shape
    s, r, k = lora_a.shape
    if x.shape != (t, k) or lora_b.shape != (s, n, r) or segments.num_tokens != t:
        raise ValueError(
            f"add_lora: shapes do not match: y {tuple(y.shape)}, x {tuple(x.shape)}, "
            f"lora_a {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}, "
            f"{segments.num_tokens} tokens in the segments"
        )
    if len({y.dtype, x.dtype, lora_a.dtype, lora_b.dtype}) != 1:
        raise ValueError(
            f"add_lora: one dtype expected, got y {y.dtype}, x {x.dtype}, "
            f"lora_a {lora_a.dtype}, lora_b {lora_b.dtype}"
        )


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: LoRASegments,
    *,
    backend: str | None = None,
) -> None:
    """In place. backend None: "triton" on CUDA tensors (and on CPU under the Triton
    interpreter, as ``dispatch.use_triton``), else "torch"."""
    if backend is None:
        backend = "triton" if use_triton(y) else "torch"
    if backend == "triton":
        from tokenwire.kernels.lora_triton import add_lora_triton

        add_lora_triton(y, x, lora_a, lora_b, segments)
    elif backend == "torch":
        add_lora_torch(y, x, lora_a, lora_b, segments)
    else:
        raise ValueError(f"add_lora: unknown backend {backend!r} (expected 'triton' or 'torch')")


def add_lora_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: LoRASegments,
) -> None:
    """The reference: one shrink (``x @ A.T``) and one fused ``addmm_`` per run, in the
    tensors' dtype (the shrink result rounds to it, as in PEFT's ``lora_B(lora_A(x))``)."""
    check_lora_shapes(y, x, lora_a, lora_b, segments)
    for start, length, slot in segments.runs:
        end = start + length
        y[start:end].addmm_(x[start:end] @ lora_a[slot].T, lora_b[slot].T)


def slot_mask(
    token_slots: torch.Tensor, num_slots: int, width: int, dtype: torch.dtype
) -> torch.Tensor:
    """[T, num_slots * width]: 1 where column ``c`` belongs to token ``t``'s slot
    (``c // width == slot(t)``), else 0 (tokens without an adapter: all 0)."""
    col_slot = torch.arange(num_slots * width, device=token_slots.device) // width
    return (token_slots.unsqueeze(1) == col_slot.unsqueeze(0)).to(dtype)


def add_lora_masked(
    y: torch.Tensor, x: torch.Tensor, a_flat: torch.Tensor, b_flat: torch.Tensor, mask: torch.Tensor
) -> None:
    """Every slot at once: ``y += ((x @ a_flat.T) * mask) @ b_flat.T`` with ``a_flat``
    [S*R, K] (slot-major) and ``b_flat`` [N, S*R] (the same column order) and ``mask`` from
    ``slot_mask``. Two matmuls per layer whatever the number of runs — the CPU path, where
    per-run dispatch costs more than the extra ``S``-fold rank columns. Exact: a masked
    column contributes exact zeros."""
    shrunk = x @ a_flat.T
    shrunk.mul_(mask)
    y.addmm_(shrunk, b_flat.T)
