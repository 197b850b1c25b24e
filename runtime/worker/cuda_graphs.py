"""Decode CUDA graphs: one graph per batch-size bucket, replayed for pure-decode steps.

Capture (``DecodeGraphs.capture``) runs once at startup, largest bucket first, every graph in
one shared memory pool (a smaller graph reuses the largest one's memory: graphs never run
concurrently). Each graph reads fixed device buffers (``_StaticInputs``) and writes the final
hidden states into one static output buffer; a replay first copies the step's inputs into
those buffers from the pinned staging buffers (non-blocking), padding rows ``[n, bucket)`` as
``kernels.cuda_graph_buckets`` prescribes: token 0, position 0, slot -1 (``store_kv`` skips
it), ``seq_len`` 0 (decode attention reads no key). Padded rows keep whatever block-table row
the buffer held: with ``seq_len`` 0 it is never read.

Graphs stay valid for any context length because the decode kernel's grid depends only on
the batch size (``default_num_splits``) and the block-table buffer has the full
``max_blocks_per_seq`` width. The padding and bucket choice are plain numpy
(``decode_bucket``, ``write_padded_decode``) and are unit-tested on CPU.

LoRA (``lora_manager``): each graph records the segmented LoRA path over the ``LoRAManager``'s
persistent segment buffers (all entries unused during capture, so warm-up and capture add
nothing); a replay applies whatever runs the step's ``set_tokens`` wrote there (none for a
base-only step: it clears them). The runs cover rows ``[0, n)`` only, so padding rows belong
to no run. A step whose LoRA layout the buffers do not describe (``LoRAManager.graphable``)
runs eagerly. The LoRA launches replay on base-only steps too (every program returns at once).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.cuda_graph_buckets import (
    PAD_POSITION,
    PAD_SEQ_LEN,
    PAD_SLOT,
    PAD_TOKEN_ID,
    padded_batch_size,
)
from tokenwire.runtime.lora.manager import LoRAManager
from tokenwire.runtime.models.llama import KVCache, LlamaForCausalLM
from tokenwire.runtime.worker.host_staging import HostStaging
from tokenwire.runtime.worker.input_batch import StepArrays

# Step inputs that are padded to the bucket on the host and copied whole ([:bucket]).
_PADDED_FIELDS: tuple[tuple[str, int], ...] = (
    ("input_ids", PAD_TOKEN_ID),
    ("positions", PAD_POSITION),
    ("slot_mapping", PAD_SLOT),
    ("seq_lens", PAD_SEQ_LEN),
)


def decode_bucket(arrays: StepArrays, buckets: tuple[int, ...]) -> int | None:
    """The bucket a step replays, or None to run it eagerly (not pure decode, or too big)."""
    num_seqs = len(arrays.seq_lens)
    if arrays.num_decodes != num_seqs or len(arrays.input_ids) != num_seqs:
        return None
    return padded_batch_size(num_seqs, buckets)


def write_padded_decode(host: Mapping[str, np.ndarray], arrays: StepArrays, bucket: int) -> None:
    """Write a pure-decode step's 1-D inputs into ``host`` buffers, padded to ``bucket`` rows."""
    n = len(arrays.seq_lens)
    if n > bucket:
        raise ValueError(f"batch of {n} does not fit bucket {bucket}")
    for name, fill in _PADDED_FIELDS:
        dst = host[name]
        dst[:n] = getattr(arrays, name)
        dst[n:bucket] = fill


@dataclass(frozen=True)
class _StaticInputs:
    """Device buffers every graph reads; sized for the largest bucket."""

    input_ids: torch.Tensor  # int64 [max_bucket]
    positions: torch.Tensor  # int64 [max_bucket]
    slot_mapping: torch.Tensor  # int64 [max_bucket]
    seq_lens: torch.Tensor  # int32 [max_bucket]
    query_start_loc: torch.Tensor  # int32 [max_bucket + 1] = 0, 1, ..., max_bucket (constant)
    block_tables: torch.Tensor  # int32 [max_bucket, max_blocks_per_seq]
    hidden: torch.Tensor  # model dtype [max_bucket, hidden_size]: every graph's output

    @staticmethod
    def allocate(
        max_bucket: int, max_blocks_per_seq: int, hidden_size: int, dtype: torch.dtype,
        device: torch.device,
    ) -> _StaticInputs:  # fmt: skip
        def longs(fill: int) -> torch.Tensor:
            return torch.full((max_bucket,), fill, dtype=torch.int64, device=device)

        return _StaticInputs(
            input_ids=longs(PAD_TOKEN_ID),
            positions=longs(PAD_POSITION),
            slot_mapping=longs(PAD_SLOT),
            seq_lens=torch.full((max_bucket,), PAD_SEQ_LEN, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_bucket + 1, dtype=torch.int32, device=device),
            block_tables=torch.zeros(
                (max_bucket, max_blocks_per_seq), dtype=torch.int32, device=device
            ),
            hidden=torch.zeros((max_bucket, hidden_size), dtype=dtype, device=device),
        )


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_layers: list[KVCache],
        buckets: tuple[int, ...],
        block_size: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        lora_manager: LoRAManager | None = None,
    ) -> None:
        self.model = model
        self.lora = lora_manager
        self.kv_layers = kv_layers
        self.buckets = buckets
        self.block_size = block_size
        self.max_model_len = max_model_len
        weight = model.lm_head_weight
        self.static = _StaticInputs.allocate(
            buckets[-1], max_blocks_per_seq, model.arch.hidden_size, weight.dtype, weight.device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _meta(self, bucket: int) -> AttentionMetadata:
        """Metadata of a captured bucket: all rows are one-token decodes."""
        s = self.static
        return AttentionMetadata(
            num_tokens=bucket,
            num_seqs=bucket,
            num_decodes=bucket,
            block_size=self.block_size,
            slot_mapping=s.slot_mapping[:bucket],
            query_start_loc=s.query_start_loc[: bucket + 1],
            seq_lens=s.seq_lens[:bucket],
            block_tables=s.block_tables[:bucket],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # an upper bound: lengths vary between replays
            query_start_loc_np=np.arange(bucket + 1, dtype=np.int32),
            seq_lens_np=np.zeros(bucket, dtype=np.int32),  # host copy unknown at capture
        )

    def bucket_for(self, arrays: StepArrays) -> int | None:
        """The bucket this step replays, or None to run it eagerly (``decode_bucket``, and
        with LoRA only while its runs are in the buffers the graphs read)."""
        bucket = decode_bucket(arrays, self.buckets)
        if bucket is None or self.lora is None:
            return bucket
        return bucket if self.lora.graphable(len(arrays.input_ids)) else None

    def _lora_rows(self, bucket: int) -> AbstractContextManager[None]:
        return nullcontext() if self.lora is None else self.lora.graph_rows(bucket)

    def _run(self, bucket: int, meta: AttentionMetadata) -> None:
        s = self.static
        with self._lora_rows(bucket):
            hidden = self.model(s.input_ids[:bucket], s.positions[:bucket], self.kv_layers, meta)
        s.hidden[:bucket].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool. The static inputs hold
        padding values (slot -1, seq_len 0), so warm-up and capture write no KV; the LoRA
        segment buffers hold no run, so they add no LoRA delta either."""
        if self.lora is not None:
            self.lora.clear_runs()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            meta = self._meta(bucket)
            # Warm-up outside capture: Triton compiles, cuBLAS picks its algorithms.
            self._run(bucket, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(bucket, meta)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def replay(self, staging: HostStaging, arrays: StepArrays, bucket: int) -> torch.Tensor:
        """Run a pure-decode step through the ``bucket`` graph; hidden states [n, hidden]."""
        s = self.static
        staging.begin()
        write_padded_decode(staging.host, arrays, bucket)
        for name, _ in _PADDED_FIELDS:
            getattr(s, name)[:bucket].copy_(staging.pinned[name][:bucket], non_blocking=True)
        rows, cols = arrays.block_tables.shape
        s.block_tables[:rows, :cols].copy_(
            staging.put_table(arrays.block_tables), non_blocking=True
        )
        staging.end()
        self.graphs[bucket].replay()
        # A view of the static output: valid until the next replay (the step consumes it).
        return s.hidden[:rows]
