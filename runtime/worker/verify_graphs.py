"""Verify CUDA graphs: speculative verify steps replayed with ``q = 1 + k`` query tokens per row.

A verify step gives each drafted row ``1 + k_i`` query tokens (``[last token, d_1 .. d_k_i]``,
``k_i <= k = num_speculative_tokens``) and each row without drafts one. ``VerifyGraphs`` holds
one graph per batch bucket (``kernels.cuda_graph_buckets``) whose every row has exactly ``q``
query tokens, all through the Triton prefill kernel (``num_decodes = 0``): its grid is a
function of the host ints ``bucket * q`` and ``bucket`` only, and ``query_start_loc`` is the
constant ``0, q, 2q, ..`` so it is a static buffer that never changes between replays.

Short rows are padded, not run eagerly. N-gram lookup often finds fewer than ``k`` tokens (or
none) for some rows, so at 64 streams nearly every verify step mixes row lengths: a rule that
graphed only steps where every row drafted exactly ``k`` would almost never replay. Padding
costs at most ``q - 1`` extra tokens per short row in the GEMMs, which are weight-bound at
these batch sizes, and one small index upload plus a gather of the real rows afterwards
(skipped when every row is full). The padding (``write_padded_verify``):

* A short row's padding tokens go **before** its real tokens (token 0, slot -1: ``store_kv``
  skips them, so they store no KV) and the row keeps its real ``seq_len``. The kernel places a
  row's queries at ``seq_len - q ..``, so the real tokens keep their true positions and causal
  masks; the padding queries sit at earlier positions (negative ones see no key) and read
  only keys the row already has, through block-table columns the row owns: nothing reads out
  of bounds. Their RoPE position is the row's first real position (in range of every table).
  Their outputs are dropped by the gather; the attention of real tokens never sees them.
* Padding rows ``[n, bucket)`` are ``q`` padding tokens at position 0 with ``seq_len`` 0: the
  kernel walks no key for them and writes zeros; their stale block-table rows are never read.

Any step whose rows all have ``1 .. q`` query tokens and at least one has more than one is
replayed this way (``verify_bucket``): the same argument holds for a short prefill chunk, and
the step is computed exactly as eagerly. A row longer than ``q`` (a prefill chunk), a step
larger than every bucket, image / M-RoPE steps and pure decode (the decode graphs' job) run
otherwise. Rows without drafts go through the prefill kernel instead of split-KV decode, so
their hidden states match the eager step to float rounding, not bit for bit.

Memory: buckets stop where ``bucket * q`` would exceed ``max_num_batched_tokens`` (no step can
hold more tokens), and capture reuses the decode graphs' memory pool (``CUDAGraph.pool()``),
so the pool never needs more than one activation peak of ``max_num_batched_tokens`` tokens:
the ``graph_reserve`` that ``kv_cache_sizing.gpu_num_blocks`` already sets aside when graphs
are enabled. The static buffers add ``max_bucket * q`` hidden rows: not accounted (a few MiB).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.cuda_graph_buckets import (
    PAD_POSITION,
    PAD_SEQ_LEN,
    PAD_SLOT,
    PAD_TOKEN_ID,
    decode_batch_buckets,
    padded_batch_size,
)
from tokenwire.runtime.loader.model_loader import LoadedModel
from tokenwire.runtime.models.llama import KVCache, LlamaForCausalLM
from tokenwire.runtime.worker.host_staging import HostStaging
from tokenwire.runtime.worker.input_batch import StepArrays
from tokenwire.runtime.worker.kv_cache import KVCache as RunnerKVCache
from tokenwire.runtime.worker.runner_settings import RunnerSettings

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

# Per-token step inputs padded on the host and copied whole ([:bucket * q]).
_TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping")


def verify_buckets(
    max_num_seqs: int, max_num_batched_tokens: int, query_len: int
) -> tuple[int, ...]:
    """Decode buckets whose ``bucket * query_len`` tokens fit one step; () when none does."""
    buckets = decode_batch_buckets(max_num_seqs)
    return tuple(b for b in buckets if b * query_len <= max_num_batched_tokens)


def verify_bucket(arrays: StepArrays, buckets: tuple[int, ...], query_len: int) -> int | None:
    """The bucket a step replays, or None to run it otherwise: pure decode, a row longer than
    ``query_len``, or more rows than the largest bucket."""
    if not buckets or query_len < 2:
        return None
    longest = int(np.diff(arrays.query_start_loc).max())
    if longest < 2 or longest > query_len:
        return None
    return padded_batch_size(len(arrays.seq_lens), buckets)


def write_padded_verify(
    host: Mapping[str, np.ndarray], arrays: StepArrays, bucket: int, query_len: int
) -> np.ndarray:
    """Write a step's inputs into ``host``, each row padded to ``query_len`` tokens (padding
    first) and the rows to ``bucket``; returns the padded index of every real token."""
    n, q = len(arrays.seq_lens), query_len
    if n > bucket:
        raise ValueError(f"batch of {n} does not fit bucket {bucket}")
    qsl = arrays.query_start_loc.astype(np.int64)
    lens = np.diff(qsl)
    if lens.max() > q:
        raise ValueError(f"a row has {int(lens.max())} query tokens, more than {q}")
    seq_of_token = np.repeat(np.arange(n), lens)
    offsets = np.arange(len(arrays.input_ids)) - qsl[:-1][seq_of_token]
    dest: np.ndarray = seq_of_token * q + (q - lens)[seq_of_token] + offsets
    total = bucket * q
    host["input_ids"][:total] = PAD_TOKEN_ID
    host["slot_mapping"][:total] = PAD_SLOT
    positions = host["positions"]
    positions[: n * q] = np.repeat(arrays.positions[qsl[:-1]], q)  # each row's first position
    positions[n * q : total] = PAD_POSITION
    for name in _TOKEN_FIELDS:
        host[name][dest] = getattr(arrays, name)
    host["seq_lens"][:n] = arrays.seq_lens
    host["seq_lens"][n:bucket] = PAD_SEQ_LEN
    return dest


@dataclass(frozen=True)
class _StaticInputs:
    """Device buffers every verify graph reads; sized for the largest bucket."""

    input_ids: torch.Tensor  # int64 [max_bucket * q]
    positions: torch.Tensor  # int64 [max_bucket * q]
    slot_mapping: torch.Tensor  # int64 [max_bucket * q]
    seq_lens: torch.Tensor  # int32 [max_bucket]
    query_start_loc: torch.Tensor  # int32 [max_bucket + 1] = 0, q, 2q, .. (constant)
    block_tables: torch.Tensor  # int32 [max_bucket, max_blocks_per_seq]
    hidden: torch.Tensor  # model dtype [max_bucket * q, hidden_size]: every graph's output

    @staticmethod
    def allocate(
        max_bucket: int, q: int, max_blocks_per_seq: int, hidden_size: int, dtype: torch.dtype,
        device: torch.device,
    ) -> _StaticInputs:  # fmt: skip
        def longs(fill: int) -> torch.Tensor:
            return torch.full((max_bucket * q,), fill, dtype=torch.int64, device=device)

        return _StaticInputs(
            input_ids=longs(PAD_TOKEN_ID),
            positions=longs(PAD_POSITION),
            slot_mapping=longs(PAD_SLOT),
            seq_lens=torch.full((max_bucket,), PAD_SEQ_LEN, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(0, (max_bucket + 1) * q, q, dtype=torch.int32).to(device),
            block_tables=torch.zeros(
                (max_bucket, max_blocks_per_seq), dtype=torch.int32, device=device
            ),
            hidden=torch.zeros((max_bucket * q, hidden_size), dtype=dtype, device=device),
        )


class VerifyGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_layers: list[KVCache],
        buckets: tuple[int, ...],
        query_len: int,
        block_size: int,
        max_blocks_per_seq: int,
        max_model_len: int,
    ) -> None:
        if not buckets or query_len < 2:
            raise ValueError(f"verify graphs need buckets and q >= 2, got {buckets}, {query_len}")
        self.model = model
        self.kv_layers = kv_layers
        self.buckets = buckets
        self.query_len = query_len
        self.block_size = block_size
        self.max_model_len = max_model_len
        weight = model.lm_head_weight
        self.static = _StaticInputs.allocate(
            buckets[-1], query_len, max_blocks_per_seq, model.arch.hidden_size, weight.dtype,
            weight.device,
        )  # fmt: skip
        # Host side of the real-token index (pinned on CUDA: its copy is non-blocking).
        self._index = torch.zeros(
            buckets[-1] * query_len, dtype=torch.int64, pin_memory=weight.device.type == "cuda"
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _meta(self, bucket: int) -> AttentionMetadata:
        """Metadata of a captured bucket: ``bucket`` rows of ``q`` query tokens each."""
        s, q = self.static, self.query_len
        return AttentionMetadata(
            num_tokens=bucket * q,
            num_seqs=bucket,
            num_decodes=0,
            block_size=self.block_size,
            slot_mapping=s.slot_mapping[: bucket * q],
            query_start_loc=s.query_start_loc[: bucket + 1],
            seq_lens=s.seq_lens[:bucket],
            block_tables=s.block_tables[:bucket],
            max_query_len=q,
            max_seq_len=self.max_model_len,  # an upper bound: lengths vary between replays
            query_start_loc_np=np.arange(0, (bucket + 1) * q, q, dtype=np.int32),
            seq_lens_np=np.zeros(bucket, dtype=np.int32),  # host copy unknown at capture
        )

    def _run(self, bucket: int, meta: AttentionMetadata) -> None:
        s, t = self.static, bucket * self.query_len
        hidden = self.model(s.input_ids[:t], s.positions[:t], self.kv_layers, meta)
        s.hidden[:t].copy_(hidden)

    @torch.inference_mode()
    def capture(self, pool: _POOL_HANDLE | None = None) -> None:
        """Capture every bucket, largest first, into ``pool`` (the decode graphs' pool; a new
        one when None). The static inputs hold padding (slot -1), so capture writes no KV."""
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        for bucket in reversed(self.buckets):
            meta = self._meta(bucket)
            self._run(bucket, meta)  # warm-up outside capture: Triton compiles, cuBLAS picks
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(bucket, meta)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def try_replay(self, staging: HostStaging, arrays: StepArrays) -> torch.Tensor | None:
        """Hidden states [num_tokens, hidden] of a graphable step; None: run it otherwise."""
        bucket = verify_bucket(arrays, self.buckets, self.query_len)
        return None if bucket is None else self.replay(staging, arrays, bucket)

    def replay(self, staging: HostStaging, arrays: StepArrays, bucket: int) -> torch.Tensor:
        """Run a verify step through the ``bucket`` graph; the real tokens' hidden states."""
        s, t = self.static, bucket * self.query_len
        staging.begin()
        dest = write_padded_verify(staging.host, arrays, bucket, self.query_len)
        for name in _TOKEN_FIELDS:
            getattr(s, name)[:t].copy_(staging.pinned[name][:t], non_blocking=True)
        s.seq_lens[:bucket].copy_(staging.pinned["seq_lens"][:bucket], non_blocking=True)
        rows, cols = arrays.block_tables.shape
        s.block_tables[:rows, :cols].copy_(
            staging.put_table(arrays.block_tables), non_blocking=True
        )
        full = len(dest) == rows * self.query_len  # every row full: real tokens are a prefix
        index = None
        if not full:
            self._index.numpy()[: len(dest)] = dest
            index = self._index[: len(dest)].to(s.hidden.device, non_blocking=True)
        staging.end()
        self.graphs[bucket].replay()
        if index is None:  # a view of the static output, valid until the next replay
            return s.hidden[: len(dest)]
        return s.hidden.index_select(0, index)


def build_verify_graphs(
    loaded: LoadedModel,
    kv_cache: RunnerKVCache,
    settings: RunnerSettings,
    num_speculative_tokens: int,
) -> VerifyGraphs | None:
    """Uncaptured verify graphs for ``1 + k`` query tokens per row; None without speculation
    or when no bucket of such rows fits ``max_num_batched_tokens``."""
    q = 1 + num_speculative_tokens
    buckets = verify_buckets(settings.max_num_seqs, settings.max_num_batched_tokens, q)
    if num_speculative_tokens < 1 or not buckets:
        return None
    block_size = kv_cache.block_size
    return VerifyGraphs(
        loaded.model, kv_cache.layers, buckets, q, block_size,
        -(-loaded.max_model_len // block_size), loaded.max_model_len,
    )  # fmt: skip
