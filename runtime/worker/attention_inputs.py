"""A step's host arrays as device tensors and attention metadata, without the CUDA staging.

The CPU path of the model runner and the draft model's forwards (on any device) build their
inputs here: ``to_device`` copies a host array (non-blocking on an accelerator) and
``metadata`` builds the step's ``AttentionMetadata``, on CPU with the gather plans of the
model's sliding ``windows``. The CUDA target forward stages through pinned buffers instead
(``cuda_runner``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenwire.kernels.attention_metadata import AttentionMetadata, ImageSpans
from tokenwire.kernels.attention_plan import build_cpu_plan
from tokenwire.runtime.worker.input_batch import StepArrays


@dataclass(frozen=True)
class AttentionInputs:
    """Builds one model's step inputs: ``windows`` are its distinct sliding windows,
    ``chunks`` its distinct attention chunk sizes (Llama 4)."""

    device: torch.device
    block_size: int
    windows: tuple[int, ...]
    chunks: tuple[int, ...] = ()

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)

    def metadata(self, a: StepArrays, image_spans: ImageSpans = ()) -> AttentionMetadata:
        """The step's attention metadata; on CPU with gather plans for ``windows``;
        ``image_spans``: the step's bidirectional image runs (Gemma 3)."""
        block_tables = self.to_device(a.block_tables)
        plan = None
        if self.device.type == "cpu":
            plan = build_cpu_plan(
                a.query_start_loc, a.seq_lens, block_tables, a.num_decodes, self.block_size,
                self.windows, self.chunks,
            )  # fmt: skip
        return AttentionMetadata(
            num_tokens=len(a.input_ids),
            num_seqs=len(a.seq_lens),
            num_decodes=a.num_decodes,
            block_size=self.block_size,
            slot_mapping=self.to_device(a.slot_mapping),
            query_start_loc=self.to_device(a.query_start_loc),
            seq_lens=self.to_device(a.seq_lens),
            block_tables=block_tables,
            max_query_len=a.max_query_len,
            max_seq_len=a.max_seq_len,
            query_start_loc_np=a.query_start_loc,
            seq_lens_np=a.seq_lens,
            cpu_plan=plan,
            image_spans=image_spans,
        )
