"""Tensor-parallel layers (Megatron-style, as in vLLM), each built with an explicit ``TPGroup``.

- ``QKVParallelLinear``: column-parallel by heads. Query heads split evenly; KV heads split
  evenly or, with fewer KV heads than ranks, are replicated (see ``arch.split_heads``). The
  local fused weight is ``[q | k | v]`` of this rank's heads; a qkv bias is split the same way.
- ``MergedColumnParallelLinear``: several column-parallel outputs fused into one matmul (MLP
  ``gate_up_proj``: this rank's gate rows, then its up rows, the order ``silu_and_mul`` wants).
- ``RowParallelLinear``: input dim split; the partial products are summed with
  ``tp.all_reduce``, then the (replicated) bias is added once.
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded up to a multiple of
  the TP size, each rank holding a contiguous range of rows (padding rows are zero). Ids
  outside a rank's range embed to zeros locally and the all-reduce assembles the rows;
  ``vocab_parallel_logits`` all-gathers the per-rank logit shards, so every rank returns the
  same (bitwise) float32 ``[N, vocab_size]`` logits and samples identically.

With ``TPGroup.single()`` every layer holds the full tensors and runs exactly what the
plain layers in ``basic`` run (no masking, no collectives): TP=1 results are unchanged.

Each layer describes how its parameters are cut from checkpoint tensors (``shard_loads``);
the model's ``load_weights`` uses that to read only this rank's slices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.models.arch import TP_FLAG, split_heads
from tokenwire.runtime.models.weights import ShardLoad, replicated, split

# Local parameter name ("weight", "bias") -> checkpoint shard id ("" when not fused, else
# "q"/"k"/"v" or a merged output's name, in storage order) -> where that tensor goes.
ShardLoads = dict[str, dict[str, ShardLoad]]


class ShardedModule(nn.Module):
    """A layer whose parameters are (possibly) slices of the checkpoint's tensors."""

    def shard_loads(self) -> ShardLoads:
        raise NotImplementedError


def _even_share(size: int, tp: TPGroup, what: str) -> tuple[int, int]:
    """(start, length) of this rank's share of ``size``; the error names the flag."""
    if size % tp.world_size:
        raise ValueError(
            f"{TP_FLAG}={tp.world_size} does not divide the model's {what} ({size}): "
            "choose a tensor-parallel size that divides it"
        )
    length = size // tp.world_size
    return tp.rank * length, length


class QKVParallelLinear(ShardedModule):
    """Fused q/k/v projection holding this rank's query and KV heads."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.heads = split_heads(num_heads, num_kv_heads, tp.rank, tp.world_size)
        self.num_heads = self.heads.num_heads
        self.num_kv_heads = self.heads.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        out = self.q_size + 2 * self.kv_size
        self.weight = nn.Parameter(torch.empty(out, hidden_size, dtype=dtype))
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def shard_loads(self) -> ShardLoads:
        d = self.head_dim
        full_q, full_kv = self.total_num_heads * d, self.total_num_kv_heads * d
        q_start, kv_start = self.heads.head_start * d, self.heads.kv_head_start * d
        loads: ShardLoads = {}
        for name, param in self.named_parameters(recurse=False):
            rest = tuple(param.shape[1:])
            loads[name] = {
                "q": split((full_q, *rest), 0, q_start, self.q_size, 0),
                "k": split((full_kv, *rest), 0, kv_start, self.kv_size, self.q_size),
                "v": split((full_kv, *rest), 0, kv_start, self.kv_size, self.q_size + self.kv_size),
            }
        return loads


class MergedColumnParallelLinear(ShardedModule):
    """Several column-parallel outputs in one matmul: this rank's rows of each, in order."""

    def __init__(
        self,
        in_features: int,
        output_sizes: dict[str, int],
        bias: bool,
        dtype: torch.dtype,
        tp: TPGroup,
        what: str = "output size",
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = dict(output_sizes)
        self.shares = {
            name: _even_share(size, tp, what) for name, size in self.output_sizes.items()
        }
        out = sum(length for _, length in self.shares.values())
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype))
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def shard_loads(self) -> ShardLoads:
        loads: ShardLoads = {}
        for name, param in self.named_parameters(recurse=False):
            rest = tuple(param.shape[1:])
            per_shard: dict[str, ShardLoad] = {}
            offset = 0
            for shard, (start, length) in self.shares.items():
                full = (self.output_sizes[shard], *rest)
                per_shard[shard] = split(full, 0, start, length, offset)
                offset += length
            loads[name] = per_shard
        return loads


class RowParallelLinear(ShardedModule):
    """``y = all_reduce(x_local @ W_local.T) + b``: input features split over ranks."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TPGroup,
        what: str = "input size",
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.input_start, self.input_size = _even_share(in_features, tp, what)
        self.weight = nn.Parameter(torch.empty(out_features, self.input_size, dtype=dtype))
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(F.linear(x, self.weight))
        if self.bias is not None:
            out.add_(self.bias)  # once, after the sum of partial products
        return out

    def shard_loads(self) -> ShardLoads:
        full = (self.out_features, self.in_features)
        loads: ShardLoads = {
            "weight": {"": split(full, 1, self.input_start, self.input_size)},
        }
        if self.bias is not None:
            loads["bias"] = {"": replicated(self.bias.shape)}
        return loads


def vocab_shard(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """(start, length) of this rank's rows of the vocabulary padded to a multiple of TP."""
    per_rank = -(-vocab_size // tp.world_size)
    return tp.rank * per_rank, per_rank


class VocabParallelEmbedding(ShardedModule):
    """Token id -> row of the embedding matrix, rows split over ranks (padding rows zero)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, tp: TPGroup
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings  # the real vocabulary size
        self.embedding_dim = embedding_dim
        self.vocab_start, self.num_local = vocab_shard(num_embeddings, tp)
        self.vocab_end = self.vocab_start + self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, embedding_dim, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def shard_loads(self) -> ShardLoads:
        full = (self.num_embeddings, self.embedding_dim)
        return {"weight": {"": split(full, 0, self.vocab_start, self.num_local)}}


class ParallelLMHead(VocabParallelEmbedding):
    """The untied output projection: same row split as the embedding; logits come from
    ``vocab_parallel_logits`` (never from ``forward``)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead has no forward: use vocab_parallel_logits")


def vocab_parallel_logits(
    hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: TPGroup
) -> torch.Tensor:
    """[N, hidden] x this rank's vocab rows -> float32 logits [N, vocab_size] on every rank.

    The local shards are all-gathered (in the model dtype) and the padding trimmed; every
    rank receives the same bytes, so the result is bitwise identical across ranks. Every rank
    must make the same calls in the same order (it is a collective).
    """
    logits = F.linear(hidden, weight)
    if tp.world_size == 1:
        return logits.float()
    gathered = tp.all_gather(logits, dim=-1)
    if gathered.shape[-1] != vocab_size:
        gathered = gathered[..., :vocab_size].contiguous()
    return gathered.float()
