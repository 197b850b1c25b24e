"""The model runner's KV caches: the target's (sized for the device; on CUDA with its graph
executor) and, for ``draft_model`` speculation, the draft's over the same block ids, which
shares the target's memory budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenwire.runtime.loader.model_loader import LoadedModel
from tokenwire.runtime.lora.manager import LoRAManager
from tokenwire.runtime.models.windows import distinct_chunks, distinct_windows
from tokenwire.runtime.worker.attention_inputs import AttentionInputs
from tokenwire.runtime.worker.kv_cache import KVCache, kv_cache_summary
from tokenwire.runtime.worker.runner_settings import RunnerSettings
from tokenwire.runtime.worker.spec.draft_model import DraftModel, draft_bytes_per_block

if TYPE_CHECKING:
    from tokenwire.runtime.worker.cuda_runner import CudaGraphRunner

logger = logging.getLogger("tokenwire.worker")


@dataclass(frozen=True)
class RunnerCaches:
    kv_cache: KVCache
    cuda: CudaGraphRunner | None  # CUDA devices: graph capture/replay over ``kv_cache``
    drafter: DraftModel | None  # the draft model with its own cache


def build_caches(
    loaded: LoadedModel,
    draft: LoadedModel | None,
    settings: RunnerSettings,
    device: torch.device,
    tp_size: int,
    spec_tokens: int = 0,
    lora_manager: LoRAManager | None = None,
) -> RunnerCaches:
    """``spec_tokens``: ``num_speculative_tokens`` (0: none) for the CUDA verify graphs."""
    cache_config = settings.cache
    extra = 0 if draft is None else draft_bytes_per_block(draft, cache_config, tp_size)
    cuda = None
    if device.type == "cuda":
        from tokenwire.runtime.worker.cuda_runner import CudaGraphRunner, cuda_kv_cache

        kv_cache = cuda_kv_cache(loaded, settings, tp_size, extra)
        cuda = CudaGraphRunner(loaded, kv_cache, settings, spec_tokens, lora_manager)
    else:
        # An automatic CPU budget holds no more than the scheduler's sequences can use.
        per_seq = -(-loaded.max_model_len // cache_config.block_size)
        usable = 1 + settings.max_num_seqs * per_seq  # block 0 is the null block
        kv_cache = KVCache.allocate(
            loaded.arch, cache_config, device, loaded.dtype, None, tp_size, extra, usable
        )
    logger.info("%s", kv_cache_summary(loaded.arch, kv_cache, tp_size))
    drafter = None
    if draft is not None:  # the same blocks, the draft's own layers and heads
        draft_kv = KVCache.allocate(
            draft.arch, cache_config, device, draft.dtype, kv_cache.num_blocks, tp_size
        )
        inputs = AttentionInputs(
            device,
            cache_config.block_size,
            distinct_windows(draft.arch),
            distinct_chunks(draft.arch),
        )
        drafter = DraftModel(draft, draft_kv, inputs)
    return RunnerCaches(kv_cache, cuda, drafter)
