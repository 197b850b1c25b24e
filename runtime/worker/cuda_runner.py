"""The CUDA half of the model runner: KV sizing, pinned-buffer inputs, decode graph replay.

``ModelRunner`` delegates here when its device is CUDA; the CPU path never imports this
module. ``cuda_kv_cache`` sizes and allocates the paged KV cache from a profiling forward
(``kv_cache_sizing``); ``CudaGraphRunner.forward`` turns a step's host arrays into hidden states,
replaying a decode CUDA graph when the step is pure decode and fits a bucket, a verify graph
(``verify_graphs``) when every row has at most ``1 + k`` query tokens, and running eagerly
otherwise. Both read the runner's ``RunnerSettings`` (``max_num_seqs`` is the largest
decode bucket). Nothing here reads device values back to the host: the step's one sync is the
sampler's read of the sampled ids.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenwire.kernels.attention_metadata import AttentionMetadata, ImageSpans
from tokenwire.kernels.cuda_graph_buckets import decode_batch_buckets
from tokenwire.kernels.dispatch import triton_available
from tokenwire.runtime.loader.model_loader import LoadedModel
from tokenwire.runtime.lora.manager import LoRAManager
from tokenwire.runtime.worker.cuda_graphs import DecodeGraphs
from tokenwire.runtime.worker.host_staging import HostStaging
from tokenwire.runtime.worker.input_batch import StepArrays
from tokenwire.runtime.worker.kv_cache import KVCache, bytes_per_block, kv_cache_torch_dtype
from tokenwire.runtime.worker.kv_cache_sizing import gpu_num_blocks, min_blocks_for, profile_memory
from tokenwire.runtime.worker.runner_settings import RunnerSettings
from tokenwire.runtime.worker.verify_graphs import VerifyGraphs, build_verify_graphs


def cuda_kv_cache(
    loaded: LoadedModel,
    settings: RunnerSettings,
    tp_size: int = 1,
    extra_bytes_per_block: int = 0,
) -> KVCache:
    """Allocate this rank's KV cache (its local KV heads under ``tp_size``-way tensor
    parallelism): ``num_gpu_blocks_override``, else what fits after profiling, sharing the
    memory with ``extra_bytes_per_block`` of another cache (a draft model's)."""
    cache_config = settings.cache
    num_blocks = cache_config.num_gpu_blocks_override
    if num_blocks is None:
        kv_dtype = kv_cache_torch_dtype(cache_config.kv_cache_dtype, loaded.dtype)
        report = profile_memory(
            loaded.model,
            settings.max_num_batched_tokens,
            settings.max_num_seqs,
            loaded.max_model_len,
            cache_config.block_size,
            kv_dtype,
        )
        num_blocks = gpu_num_blocks(
            report,
            cache_config.gpu_memory_utilization,
            bytes_per_block(loaded.arch, cache_config.block_size, kv_dtype, tp_size)
            + extra_bytes_per_block,
            min_blocks_for(loaded.max_model_len, cache_config.block_size),
            graphs_enabled(settings.enforce_eager),
        )
    return KVCache.allocate(
        loaded.arch, cache_config, loaded.device, loaded.dtype, num_blocks, tp_size
    )


def graphs_enabled(enforce_eager: bool) -> bool:
    """Decode graphs need the Triton kernels: the torch reference path syncs the host."""
    return not enforce_eager and triton_available()


class CudaGraphRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        kv_cache: KVCache,
        settings: RunnerSettings,
        num_speculative_tokens: int = 0,
        lora_manager: LoRAManager | None = None,
    ) -> None:
        """``num_speculative_tokens``: ``k`` of speculative decoding (0: none); verify steps
        replay ``verify_graphs`` captured for ``1 + k`` query tokens per row, except with
        LoRA (the verify graphs do not capture the adapters' segmented path: such steps run
        eagerly). ``lora_manager``: the model's LoRA manager (its layers already wrapped):
        the decode graphs capture its segmented path and replay each step's runs."""
        self.model = loaded.model
        self.kv_layers = kv_cache.layers
        self.block_size = kv_cache.block_size
        max_blocks_per_seq = -(-loaded.max_model_len // self.block_size)
        self.staging = HostStaging(
            settings.max_num_batched_tokens,
            settings.max_num_seqs,
            max_blocks_per_seq,
            loaded.device,
        )
        self.graphs: DecodeGraphs | None = None
        self.verify: VerifyGraphs | None = None
        if graphs_enabled(settings.enforce_eager):
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_layers,
                decode_batch_buckets(settings.max_num_seqs),
                self.block_size,
                max_blocks_per_seq,
                loaded.max_model_len,
                lora_manager,
            )
            self.graphs.capture()
            spec_tokens = 0 if lora_manager is not None else num_speculative_tokens
            self.verify = build_verify_graphs(loaded, kv_cache, settings, spec_tokens)
            if self.verify is not None:  # the decode graphs' pool: graphs never run together
                self.verify.capture(next(iter(self.graphs.graphs.values())).pool())

    def forward(
        self,
        arrays: StepArrays,
        embeds: torch.Tensor | None = None,
        spans: ImageSpans = (),
        mrope: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of one step (graph replay or eager);
        ``embeds``: the step's input embeddings (image features placed), run eagerly, as do
        steps with bidirectional image runs (``spans``, ``AttentionMetadata.image_spans``)
        and M-RoPE steps (``mrope``: their 3D positions [3, T])."""
        graphs = self.graphs
        if graphs is not None and embeds is None and not spans and mrope is None:
            bucket = graphs.bucket_for(arrays)
            if bucket is not None:
                return graphs.replay(self.staging, arrays, bucket)
            replayed = None if self.verify is None else self.verify.try_replay(self.staging, arrays)
            if replayed is not None:
                return replayed
        return self._eager(arrays, embeds, spans, mrope)

    def _eager(
        self,
        arrays: StepArrays,
        embeds: torch.Tensor | None = None,
        spans: ImageSpans = (),
        mrope: np.ndarray | None = None,
    ) -> torch.Tensor:
        inputs = self.staging.upload(arrays)
        positions = inputs.positions
        if mrope is not None:
            positions = torch.from_numpy(mrope).to(positions.device, non_blocking=True)
        meta = AttentionMetadata(
            num_tokens=len(arrays.input_ids),
            num_seqs=len(arrays.seq_lens),
            num_decodes=arrays.num_decodes,
            block_size=self.block_size,
            slot_mapping=inputs.slot_mapping,
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            block_tables=inputs.block_tables,
            max_query_len=arrays.max_query_len,
            max_seq_len=arrays.max_seq_len,
            query_start_loc_np=arrays.query_start_loc,
            seq_lens_np=arrays.seq_lens,
            image_spans=spans,
        )
        hidden: torch.Tensor = self.model(inputs.input_ids, positions, self.kv_layers, meta, embeds)
        return hidden
