"""CUDA KV cache sizing: how many blocks fit after a profiling forward (vLLM's rule).

``profile_memory`` loads nothing: it runs the already-loaded model once on a dummy batch of
``max_num_batched_tokens`` prefill tokens (the largest step the scheduler can hand out) plus
logits for ``max_num_seqs`` rows, and reads the caching allocator's peak. ``gpu_num_blocks``
is pure arithmetic over that ``MemoryReport``, so it is unit-tested on CPU with fake reports:

    budget = total * gpu_memory_utilization - peak - non_torch - graph_reserve

where ``peak`` is weights + the profiled activation peak, ``non_torch`` is memory outside
torch's allocator (CUDA context, cuBLAS workspaces), and ``graph_reserve`` is one more
activation peak when decode CUDA graphs will be captured (their private memory pool is not
shared with eager steps; decode buckets hold at most ``max_num_seqs`` tokens, so for the usual
``max_num_seqs <= max_num_batched_tokens`` this bound is conservative). All sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.kv_quant import LayerKVCache
from tokenwire.runtime.models.llama import LlamaForCausalLM

_GIB = float(1 << 30)
_UTIL_FLAG = "--gpu-memory-utilization"


@dataclass(frozen=True)
class MemoryReport:
    """Device memory after loading the weights and running the profiling forward (bytes)."""

    total: int  # device memory
    weights: int  # allocated by torch after loading (weights and buffers)
    peak: int  # torch's peak allocation during the profiling forward (includes weights)
    non_torch: int  # used outside torch's caching allocator (CUDA context, cuBLAS)


def gpu_num_blocks(
    report: MemoryReport,
    utilization: float,
    bytes_per_block: int,
    min_blocks: int,
    cuda_graphs: bool,
) -> int:
    """Blocks that fit the budget; ``ValueError`` naming the flag when the model or one
    ``max_model_len`` sequence (``min_blocks``, null block included) does not fit."""
    limit = int(report.total * utilization)
    if report.weights + report.non_torch > limit:
        raise ValueError(
            f"the model's weights ({report.weights / _GIB:.2f} GiB) do not fit in "
            f"{_UTIL_FLAG}={utilization} of the device ({limit / _GIB:.2f} GiB of "
            f"{report.total / _GIB:.2f} GiB): raise {_UTIL_FLAG} or use a smaller model"
        )
    activation = max(0, report.peak - report.weights)
    graph_reserve = activation if cuda_graphs else 0
    budget = limit - report.peak - report.non_torch - graph_reserve
    num_blocks = max(0, budget) // bytes_per_block
    if num_blocks < min_blocks:
        need = min_blocks * bytes_per_block
        raise ValueError(
            f"no room for one max-length sequence in the KV cache: it needs "
            f"{need / _GIB:.2f} GiB ({min_blocks} blocks), {max(0, budget) / _GIB:.2f} GiB "
            f"is left after weights and activations: raise {_UTIL_FLAG}, lower "
            "--max-model-len or --max-num-batched-tokens, or pass --enforce-eager"
        )
    return int(num_blocks)


def min_blocks_for(max_model_len: int, block_size: int) -> int:
    """One ``max_model_len`` sequence plus the null block."""
    return 1 + -(-max_model_len // block_size)


def profile_seq_lens(num_tokens: int, max_model_len: int) -> list[int]:
    """Split the profiling batch into prefill sequences no longer than ``max_model_len``."""
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


@torch.inference_mode()
def profile_memory(
    model: LlamaForCausalLM,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
) -> MemoryReport:
    """Run one worst-case step on the CUDA device the model lives on and report memory.

    ``kv_dtype``: the KV cache's storage dtype (default: the model's), so the profiled step
    runs the attention path (de-quantizing or not) that serving will."""
    device = model.lm_head_weight.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    inputs = _profile_inputs(model, max_num_batched_tokens, max_model_len, block_size, kv_dtype)
    hidden = model(*inputs)
    rows = hidden[: min(max_num_seqs, hidden.shape[0])]
    # Logits plus the sampler's softmax-sized temporaries of a full batch of sequences.
    torch.softmax(model.compute_logits(rows), dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del hidden, rows
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    return MemoryReport(total=total, weights=weights, peak=peak, non_torch=non_torch)


def _profile_inputs(
    model: LlamaForCausalLM,
    num_tokens: int,
    max_model_len: int,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[LayerKVCache], AttentionMetadata]:
    """Dummy all-prefill batch over a one-block cache: every slot is -1 (nothing stored) and
    every block table entry is the null block 0, so attention reads only that block. An fp8
    cache gets unit scales."""
    device = model.lm_head_weight.device
    arch = model.arch
    seq_lens = np.asarray(profile_seq_lens(num_tokens, max_model_len), dtype=np.int32)
    qsl = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(seq_lens)
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in seq_lens])
    shape = (1, block_size, model.num_local_kv_heads, arch.head_dim)
    dtype = kv_dtype or model.lm_head_weight.dtype
    parts = arch.kv_cache_parts
    caches = [_profile_cache(parts, shape, dtype, device) for _ in range(arch.num_hidden_layers)]
    max_blocks = -(-int(seq_lens.max()) // block_size)
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        num_seqs=len(seq_lens),
        num_decodes=0,
        block_size=block_size,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        block_tables=torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32, device=device),
        max_query_len=int(seq_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_np=qsl,
        seq_lens_np=seq_lens,
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    return input_ids, torch.from_numpy(positions).to(device), caches, meta


def _profile_cache(
    parts: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> LayerKVCache:
    """A one-block layer cache (MLA, ``parts`` 1: K and V are one tensor)."""
    k_cache = torch.zeros(shape, dtype=dtype, device=device)
    v_cache = k_cache if parts == 1 else torch.zeros(shape, dtype=dtype, device=device)
    return LayerKVCache(k_cache, v_cache)
