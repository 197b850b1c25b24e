"""Pinned host staging buffers and non-blocking host-to-device copies of a step's inputs.

One pinned buffer per step input, sized for the largest step (``max_num_batched_tokens``
tokens, or ``max_num_seqs`` for a padded decode graph step; ``max_num_seqs`` sequences,
``max_blocks_per_seq`` block-table columns). A step's numpy arrays
are copied into the pinned buffers and from there to the device with ``non_blocking=True``,
so the copy overlaps the host's remaining work instead of staging through pageable memory.

Reuse invariant: a pinned buffer must not be rewritten while the previous step's copy out of
it may still be in flight. ``begin`` waits on the event recorded after the previous step's
copies (``end``); in steady state the previous step already synced when it read its sampled
ids, so the wait returns at once. On CPU the buffers are plain (unpinned) and nothing waits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenwire.runtime.worker.input_batch import StepArrays


@dataclass(frozen=True, slots=True)
class DeviceInputs:
    """One step's inputs on the device (views of fresh tensors; rows in batch order)."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, columns]


class HostStaging:
    def __init__(
        self,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.device = device
        # A decode graph's bucket pads up to max_num_seqs one-token rows.
        max_tokens = max(max_num_batched_tokens, max_num_seqs)
        pin = device.type == "cuda"
        self.max_blocks_per_seq = max_blocks_per_seq

        def buf(size: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, pin_memory=pin)

        self.pinned: dict[str, torch.Tensor] = {
            "input_ids": buf(max_tokens, torch.int64),
            "positions": buf(max_tokens, torch.int64),
            "slot_mapping": buf(max_tokens, torch.int64),
            "query_start_loc": buf(max_num_seqs + 1, torch.int32),
            "seq_lens": buf(max_num_seqs, torch.int32),
            "block_tables": buf(max_num_seqs * max_blocks_per_seq, torch.int32),
        }
        # numpy views share memory with the pinned tensors: writes need no extra copy.
        self.host: dict[str, np.ndarray] = {k: v.numpy() for k, v in self.pinned.items()}
        self._fence: torch.cuda.Event | None = None

    def begin(self) -> None:
        """Wait until the previous step's copies out of the pinned buffers have finished."""
        if self._fence is not None:
            self._fence.synchronize()
            self._fence = None

    def end(self) -> None:
        """Record that every copy enqueued so far reads the pinned buffers (CUDA only)."""
        if self.device.type == "cuda":
            fence = torch.cuda.Event()  # type: ignore[no-untyped-call]
            fence.record()
            self._fence = fence

    def put(self, name: str, values: np.ndarray) -> torch.Tensor:
        """Copy ``values`` into the pinned buffer ``name``; the pinned prefix (host tensor)."""
        n = values.size
        np.copyto(self.host[name][:n], values.reshape(-1), casting="same_kind")
        return self.pinned[name][:n]

    def put_table(self, block_tables: np.ndarray) -> torch.Tensor:
        """Stage a [B, columns] block table; a pinned [B, columns] host view."""
        rows, cols = block_tables.shape
        return self.put("block_tables", block_tables).view(rows, cols)

    def upload(self, arrays: StepArrays) -> DeviceInputs:
        """Stage every input of an eager step and start its non-blocking copies."""
        self.begin()
        dev = self.device

        def send(name: str, values: np.ndarray) -> torch.Tensor:
            return self.put(name, values).to(dev, non_blocking=True)

        inputs = DeviceInputs(
            input_ids=send("input_ids", arrays.input_ids),
            positions=send("positions", arrays.positions),
            slot_mapping=send("slot_mapping", arrays.slot_mapping),
            query_start_loc=send("query_start_loc", arrays.query_start_loc),
            seq_lens=send("seq_lens", arrays.seq_lens),
            block_tables=self.put_table(arrays.block_tables).to(dev, non_blocking=True),
        )
        self.end()
        return inputs
