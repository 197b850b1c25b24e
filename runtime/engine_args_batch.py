"""The batching engine flags (``BatchArgs``, the ``SchedulerConfig`` and ``CacheConfig`` fields
of ``EngineArgs``): what one step schedules and the KV cache it schedules from (block size and
budget, dtype, prefix caching, the host and disk KV tiers). Declared once, here
(``engine_args`` explains the declarations).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import get_args

from tokenwire.runtime.config import (
    CacheConfig,
    KVCacheDType,
    KVTierEvictionPolicy,
    SchedulerConfig,
    SchedulingPolicy,
)
from tokenwire.runtime.engine_args_spec import arg


@dataclass(frozen=True)
class BatchArgs:
    """The ``SchedulerConfig`` and ``CacheConfig`` settings of ``EngineArgs``, with those
    configs' defaults."""

    max_num_seqs: int = arg(
        SchedulerConfig, "max_num_seqs", "sequences scheduled in one step", type=int
    )
    max_num_batched_tokens: int = arg(
        SchedulerConfig, "max_num_batched_tokens", "tokens scheduled in one step", type=int
    )
    encoder_cache_size: int | None = arg(
        SchedulerConfig,
        "encoder_cache_size",
        "image inputs: feature vectors (placeholder tokens) the encoder-output cache keeps, "
        "keyed by image content hash and evicted least recently used (default: 8192 or "
        "--max-num-encoder-input-tokens if larger); a larger image is refused",
        type=int,
        metavar="TOKENS",
    )
    max_num_encoder_input_tokens: int | None = arg(
        SchedulerConfig,
        "max_num_encoder_input_tokens",
        "image inputs: feature vectors the vision encoder computes in one step (default: "
        "--max-num-batched-tokens); cached images cost nothing, and a step's first image may "
        "exceed it",
        type=int,
        metavar="TOKENS",
    )
    block_size: int = arg(
        CacheConfig, "block_size", "KV cache block size in tokens (a power of two)", type=int
    )
    gpu_memory_utilization: float = arg(
        CacheConfig,
        "gpu_memory_utilization",
        "CUDA: fraction of device memory for weights, activations and the KV cache",
        type=float,
    )
    kv_cache_memory: int | None = arg(
        CacheConfig,
        "kv_cache_memory",
        "CPU: KV cache size in bytes (tokenwire generate without it: what its one prompt "
        "can use, one --max-model-len sequence, at most this default)",
        type=int,
        metavar="BYTES",
    )
    kv_cache_dtype: KVCacheDType = arg(  # noqa: RUF009 (returns an immutable str)
        CacheConfig,
        "kv_cache_dtype",
        "KV cache storage: auto = the model dtype; fp8 (= fp8_e4m3) stores float8 e4m3 with a "
        "per-layer scale (1.0), half the bytes of bfloat16 and a quarter of float32",
        choices=get_args(KVCacheDType),
    )
    num_gpu_blocks_override: int | None = arg(
        CacheConfig,
        "num_gpu_blocks_override",
        "fix the number of KV blocks on any device (wins over both budgets)",
        type=int,
    )
    kv_offloading_size: float | None = arg(
        CacheConfig,
        "kv_offloading_size",
        "GiB of host memory for a KV tier under the device cache: evicted prefix blocks are "
        "kept there and copied back on a prefix hit (0 or unset: off; docs/kv-tiers.md)",
        type=float,
        metavar="GiB",
    )
    kv_offloading_disk_path: str | None = arg(
        CacheConfig,
        "kv_offloading_disk_path",
        "directory of a disk KV tier under the host tier: blocks the host tier evicts are "
        "written there (one preallocated file, checksummed records) and loaded back on a prefix "
        "hit; a restarted server reuses the records that match its model (docs/kv-tiers.md)",
        metavar="DIR",
    )
    kv_offloading_disk_size: float | None = arg(
        CacheConfig,
        "kv_offloading_disk_size",
        "GiB of disk for --kv-offloading-disk-path (preallocated at startup)",
        type=float,
        metavar="GiB",
    )
    kv_offloading_eviction_policy: KVTierEvictionPolicy = arg(  # noqa: RUF009 (a str)
        CacheConfig,
        "kv_offloading_eviction_policy",
        "which block a full KV tier (host and disk) gives up: lru = the least recently used; "
        "arc = adaptive replacement, which keeps blocks hit again through scans of blocks used "
        "once (docs/kv-tiers.md)",
        choices=get_args(KVTierEvictionPolicy),
    )
    enable_prefix_caching: bool = arg(
        CacheConfig,
        "enable_prefix_caching",
        "reuse the KV blocks of a shared prompt prefix",
        action=argparse.BooleanOptionalAction,
    )
    enable_chunked_prefill: bool = arg(
        SchedulerConfig,
        "enable_chunked_prefill",
        "split long prompts over several steps' token budgets",
        action=argparse.BooleanOptionalAction,
    )
    async_scheduling: bool = arg(
        SchedulerConfig,
        "async_scheduling",
        "plan step k+1 while step k runs (one step in flight); features it does not cover "
        "yet run synchronous steps (docs/serving.md#async-scheduling)",
        action=argparse.BooleanOptionalAction,
    )
    scheduling_policy: SchedulingPolicy = arg(  # noqa: RUF009 (returns an immutable str)
        SchedulerConfig,
        "scheduling_policy",
        "fcfs, or priority (lower value first)",
        choices=get_args(SchedulingPolicy),
    )
