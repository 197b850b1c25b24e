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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenwire.kernels.bf16_logits import Bf16LogitsWeight, bf16_logits
from tokenwire.kernels.int8_logits import Int8LogitsWeight, int8_logits
from tokenwire.kernels.invariant_linear import InvariantLinearWeight, invariant_linear
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.models.arch import TP_FLAG, split_heads
from tokenwire.runtime.models.layers.quant.base import LinearLayer, LinearMethod, ParamLayout
from tokenwire.runtime.models.layers.quant.unquantized import UnquantizedLinearMethod
from tokenwire.runtime.models.weights import ShardLoad, replicated, split

# Local parameter name ("weight", "bias", "qweight", ...) -> checkpoint shard id ("" when not
# fused, else "q"/"k"/"v" or a merged output's name, in storage order) -> where it goes.
ShardLoads = dict[str, dict[str, ShardLoad]]

BIAS_LAYOUT = ParamLayout(output_dim=0)


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


def _method(method: LinearMethod | None) -> LinearMethod:
    return UnquantizedLinearMethod() if method is None else method


def _packed(value: int, pack: int, name: str, what: str, tp: TPGroup) -> int:
    """``value // pack``; a boundary inside a packed element or a group is an impossible
    split (the error names the flag when tensor parallelism put it there)."""
    if value % pack == 0:
        return value // pack
    if tp.world_size > 1:
        raise ValueError(
            f"{TP_FLAG}={tp.world_size} splits the {what} at feature {value}, inside one of "
            f"the {pack}-feature packs or groups of the quantized {name}: choose a "
            "tensor-parallel size that keeps every rank's share a multiple of it"
        )
    raise ValueError(
        f"the model's {what} puts a shard boundary at feature {value}, inside one of the "
        f"{pack}-feature packs or groups of the quantized {name}"
    )


@dataclass(frozen=True)
class _OutputShard:
    """One checkpoint tensor's part of a column-parallel layer's output features."""

    shard: str  # "" when not fused, else "q"/"k"/"v" or a merged output's name
    full: int  # the checkpoint tensor's output features
    start: int  # this rank's first output feature of it
    length: int  # this rank's output features of it
    offset: int  # where they start among the layer's local output features


class _ColumnLinear(ShardedModule, LinearLayer):
    """Output features split over ranks (several checkpoint tensors fused in one matmul)."""

    def _create(
        self,
        in_features: int,
        shards: list[_OutputShard],
        bias: bool,
        dtype: torch.dtype,
        method: LinearMethod | None,
        tp: TPGroup,
        what: str,
    ) -> None:
        self.tp = tp
        self.what = what
        self.output_shards = shards
        self.linear_method = _method(method)
        out = sum(s.length for s in shards)
        self.linear_method.create_weights(
            self, in_features, out, dtype, full_input_size=in_features
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.register("bias", torch.empty(out, dtype=dtype), BIAS_LAYOUT)
        self.shard_loads()  # an impossible split of a packed tensor fails here, before loading

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)

    def shard_loads(self) -> ShardLoads:
        fused = len(self.output_shards) > 1
        loads: ShardLoads = {}
        for name, param in self.named_parameters(recurse=False):
            layout = self.param_layouts[name]
            per_shard: dict[str, ShardLoad] = {}
            for i, s in enumerate(self.output_shards):
                dim = layout.output_dim
                if layout.per_shard is not None:  # per-tensor scale: element i
                    per_shard[s.shard] = replicated(layout.per_shard, i, dtype=layout.dtype)
                    continue
                if dim is None:  # the same whole tensor from every shard (GPTQ g_idx)
                    per_shard[s.shard] = replicated(param.shape, dtype=layout.dtype, shared=fused)
                    continue
                pack = layout.output_pack
                full = list(param.shape)
                full[dim] = _packed(s.full, pack, name, self.what, self.tp)
                start, length, offset = (
                    _packed(v, pack, name, self.what, self.tp)
                    for v in (s.start, s.length, s.offset)
                )
                per_shard[s.shard] = split(
                    tuple(full), dim, start, length, offset, dst_dim=dim, dtype=layout.dtype
                )
            loads[name] = per_shard
        return loads


class QKVParallelLinear(_ColumnLinear):
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
        method: LinearMethod | None = None,
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
        d = head_dim
        full_q, full_kv = num_heads * d, num_kv_heads * d
        q_start, kv_start = self.heads.head_start * d, self.heads.kv_head_start * d
        shards = [
            _OutputShard("q", full_q, q_start, self.q_size, 0),
            _OutputShard("k", full_kv, kv_start, self.kv_size, self.q_size),
            _OutputShard("v", full_kv, kv_start, self.kv_size, self.q_size + self.kv_size),
        ]
        self._create(hidden_size, shards, bias, dtype, method, tp, "attention heads")


class MergedColumnParallelLinear(_ColumnLinear):
    """Several column-parallel outputs in one matmul: this rank's rows of each, in order."""

    def __init__(
        self,
        in_features: int,
        output_sizes: dict[str, int],
        bias: bool,
        dtype: torch.dtype,
        tp: TPGroup,
        what: str = "output size",
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = dict(output_sizes)
        self.shares = {
            name: _even_share(size, tp, what) for name, size in self.output_sizes.items()
        }
        shards: list[_OutputShard] = []
        offset = 0
        for name, (start, length) in self.shares.items():
            shards.append(_OutputShard(name, self.output_sizes[name], start, length, offset))
            offset += length
        self._create(in_features, shards, bias, dtype, method, tp, what)


class RowParallelLinear(ShardedModule, LinearLayer):
    """``y = all_reduce(x_local @ W_local.T) + b``: input features split over ranks."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TPGroup,
        what: str = "input size",
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.what = what
        self.in_features = in_features
        self.out_features = out_features
        self.input_start, self.input_size = _even_share(in_features, tp, what)
        self.linear_method = _method(method)
        self.linear_method.create_weights(
            self, self.input_size, out_features, dtype, full_input_size=in_features
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.register("bias", torch.empty(out_features, dtype=dtype), BIAS_LAYOUT)
        self.shard_loads()  # an impossible split of a packed tensor fails here, before loading

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.linear_method.apply(self, x, self.bias)
        out = self.tp.all_reduce(self.linear_method.apply(self, x, None))
        if self.bias is not None:
            out.add_(self.bias)  # once, after the sum of partial products
        return out

    def shard_loads(self) -> ShardLoads:
        loads: ShardLoads = {}
        for name, param in self.named_parameters(recurse=False):
            layout = self.param_layouts[name]
            dim = layout.input_dim
            if layout.per_shard is not None:  # per-tensor scale
                loads[name] = {"": replicated(layout.per_shard, dtype=layout.dtype)}
                continue
            if dim is None:  # bias; scales kept whole on every rank
                loads[name] = {"": replicated(param.shape, dtype=layout.dtype)}
                continue
            pack = layout.input_pack
            full = list(param.shape)
            full[dim] = _packed(self.in_features, pack, name, self.what, self.tp)
            start = _packed(self.input_start, pack, name, self.what, self.tp)
            length = _packed(self.input_size, pack, name, self.what, self.tp)
            loads[name] = {"": split(tuple(full), dim, start, length, dtype=layout.dtype)}
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
    hidden: torch.Tensor,
    weight: InvariantLinearWeight | Bf16LogitsWeight | Int8LogitsWeight,
    vocab_size: int,
    tp: TPGroup,
) -> torch.Tensor:
    """[N, hidden] x this rank's vocab rows -> float32 logits [N, vocab_size] on every rank.

    The local shards are all-gathered (in the model dtype) and the padding trimmed; every
    rank receives the same bytes, so the result is bitwise identical across ranks. Every rank
    must make the same calls in the same order (it is a collective). A row's logits do not
    depend on N where ``weight`` was prepared (``kernels.invariant_linear``,
    ``kernels.bf16_logits``).
    """
    if isinstance(weight, Bf16LogitsWeight):  # CPU: a bf16 head, top logits in float32
        logits = bf16_logits(hidden, weight)
    elif isinstance(weight, Int8LogitsWeight):  # CPU: an int8 head (VNNI), likewise refined
        logits = int8_logits(hidden, weight)
    else:
        logits = invariant_linear(hidden, weight)
    if tp.world_size == 1:
        return logits.float()
    gathered = tp.all_gather(logits, dim=-1)
    if gathered.shape[-1] != vocab_size:
        gathered = gathered[..., :vocab_size].contiguous()
    return gathered.float()
