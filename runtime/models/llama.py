"""One Llama-style decoder covering Llama 2/3, SmolLM, Mistral, Qwen2/2.5 and Qwen3.

Tokens are flattened (no batch dimension): a step's sequences are concatenated into ``T``
rows and ``AttentionMetadata`` says which rows belong to which sequence and where their K/V
lives in the paged cache. Projections are fused (``qkv_proj``, ``gate_up_proj``) so each layer
runs four matmuls; ``load_weights`` maps HF parameter names into the fused tensors.

Tensor parallelism: built with a ``TPGroup`` of N ranks, each rank's model holds its share of
every projection (``layers.parallel``: heads for q/k/v, rows of the vocabulary, halves of the
MLP) and its forward all-reduces after ``o_proj`` and ``down_proj`` (and the embedding);
``compute_logits`` gathers the full vocabulary on every rank. ``load_weights`` reads only this
rank's slices of each checkpoint tensor. With ``TPGroup.single()`` (the default) the model is
exactly the single-device one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenwire.kernels.activation import silu_and_mul
from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.kv_quant import LayerKVCache
from tokenwire.kernels.paged_attention import paged_attention
from tokenwire.kernels.rotary import apply_rotary, build_cos_sin_cache, compute_inv_freq
from tokenwire.kernels.store_kv import store_kv
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.layers import (
    LinearMethod,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    QuantConfig,
    RMSNorm,
    RowParallelLinear,
    ShardedModule,
    ShardLoads,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from tokenwire.runtime.models.loading import init_random, load_checkpoint
from tokenwire.runtime.models.weights import ShardLoad, WeightSource, replicated

# One layer's paged KV cache: (k_cache, v_cache), each [num_blocks, block_size, Hkv, D], and
# the (k_scale, v_scale) of an fp8 cache (None otherwise).
KVCache = LayerKVCache

_SINGLE = TPGroup.single()  # immutable: the default group of one


class Attention(nn.Module):
    """This rank's heads (all of them at TP=1); ``o_proj`` all-reduces under TP."""

    def __init__(
        self, arch: ModelArch, dtype: torch.dtype, tp: TPGroup, method: LinearMethod | None
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.attention_bias,
            dtype,
            tp,
            method,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.scale = arch.head_dim**-0.5
        self.o_proj = RowParallelLinear(
            arch.q_size, arch.hidden_size, arch.o_proj_bias, dtype, tp, "attention size", method
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = apply_rotary(q, k, positions, cos_sin_cache)
        k_cache, v_cache, k_scale, v_scale = kv_cache
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, k_scale, v_scale)
        result: torch.Tensor = self.o_proj(out.reshape(num_tokens, self.q_size))
        return result


class MLP(nn.Module):
    """SwiGLU; the intermediate dimension is split over TP ranks, ``down_proj`` all-reduces."""

    def __init__(
        self, arch: ModelArch, dtype: torch.dtype, tp: TPGroup, method: LinearMethod | None
    ) -> None:
        super().__init__()
        inter = arch.intermediate_size
        sizes = {"gate": inter, "up": inter}
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, sizes, False, dtype, tp, "intermediate_size", method
        )
        self.down_proj = RowParallelLinear(
            inter, arch.hidden_size, False, dtype, tp, "intermediate_size", method
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return result


class DecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArch, dtype: torch.dtype, tp: TPGroup, method: LinearMethod | None
    ) -> None:
        super().__init__()
        self.self_attn = Attention(arch, dtype, tp, method)
        self.mlp = MLP(arch, dtype, tp, method)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream); their sum is the layer's output."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (HF's ``model.*`` parameter prefix)."""

    def __init__(
        self, arch: ModelArch, dtype: torch.dtype, tp: TPGroup, method: LinearMethod | None
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, dtype, tp, method) for _ in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Flattened-token causal LM. Build it with ``build_model``, then load weights."""

    def __init__(
        self,
        arch: ModelArch,
        max_position: int,
        dtype: torch.dtype,
        tp: TPGroup = _SINGLE,
        quant: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        arch.check_tensor_parallel(tp.world_size)
        self.arch = arch
        self.max_position = max_position
        self.tp = tp
        # The decoder's linear layers take the scheme's method; embeddings, the LM head and
        # norms stay unquantized (as in vLLM).
        self.quant_config = quant
        method = None if quant is None else quant.linear_method()
        self.model = LlamaModel(arch, dtype, tp, method)
        # Tied models have no lm_head parameter: logits use the embedding matrix itself (under
        # TP, this rank's rows of it), so the tie cannot be broken by device moves or loading.
        self.lm_head: ParallelLMHead | None = None
        if not arch.tie_word_embeddings:
            self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, dtype, tp)
        # [max_position, head_dim] rotary table in the model dtype (layout owned by
        # kernels.rotary); a buffer so it follows ``.to(device)``, not saved in checkpoints.
        inv_freq = compute_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling_dict())
        self.cos_sin_cache: torch.Tensor
        self.register_buffer(
            "cos_sin_cache", build_cos_sin_cache(inv_freq, max_position, dtype), persistent=False
        )

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank computes and caches (all of them at TP=1)."""
        return self.arch.num_local_kv_heads(self.tp.world_size)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden] (this rank's padded vocab rows under TP); the embedding matrix
        itself when embeddings are tied."""
        if self.lm_head is None:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final-normed hidden states [T, hidden]."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} KV caches, got {len(kv_caches)}")
        hidden = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(
                positions, hidden, residual, kv_cache, meta, self.cos_sin_cache
            )
        if residual is None:  # zero-layer model
            residual = torch.zeros_like(hidden)
        normed, _ = self.model.norm.add_and_norm(hidden, residual)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab].

        Under TP a collective (the vocab shards are all-gathered): every rank must call it
        with the same N, in the same order, and every rank gets bitwise-identical logits.
        """
        return vocab_parallel_logits(hidden, self.lm_head_weight, self.arch.vocab_size, self.tp)

    def shard_loads(self) -> dict[str, dict[str, ShardLoad]]:
        """Parameter name -> checkpoint shard id ("" unless fused; q/k/v and gate/up in
        storage order) -> which part of that checkpoint tensor this rank holds, and where."""
        loads: dict[str, dict[str, ShardLoad]] = {}
        for prefix, module in self.named_modules():
            if isinstance(module, ShardedModule):
                sharded: ShardLoads = module.shard_loads()
                for local, per_shard in sharded.items():
                    loads[f"{prefix}.{local}" if prefix else local] = per_shard
        for name, param in self.named_parameters():
            if name not in loads:  # norms: every rank holds the whole tensor
                loads[name] = {"": replicated(param.shape)}
        return loads

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | WeightSource]]) -> None:
        """Copy HF-named checkpoint tensors into this model's (fused, per-rank) parameters.

        ``weights`` yields tensors or lazy ``WeightSource``s (``iter_safetensors``); under TP
        only this rank's slice of a source is read. Raises ValueError naming the checkpoint
        tensor on an unknown name, a shape or dtype mismatch, or a parameter (or fused
        shard) that the checkpoint never provided (see ``loading.load_checkpoint``).
        Quantized layers then need ``process_weights_after_loading`` (the loader calls it).
        """
        load_checkpoint(
            self,
            self.shard_loads(),
            weights,
            self._skip,
            self.arch.architecture,
            zero_biases_ok=self.quant_config is not None,
        )

    def _skip(self, hf_name: str) -> bool:
        if hf_name.endswith("rotary_emb.inv_freq"):
            return True  # recomputed from the config
        # Tied: some checkpoints store a copy of the embedding.
        return hf_name == "lm_head.weight" and self.lm_head is None

    @torch.no_grad()
    def init_random_weights(self, generator: torch.Generator, std: float) -> None:
        """N(0, std) matrices and biases, norm weights 1, drawn parameter by parameter in
        registration order from ``generator`` (quantized tensors: random codes, constant
        scales).

        At TP=1 each parameter is drawn in place. Under TP each rank draws the full (TP=1)
        tensor on its device and keeps its slice, so a TP=N dummy model holds exactly the
        TP=1 dummy weights (every rank must use the same seed); the full tensor of one
        parameter at a time is the only extra memory.
        """
        init_random(self, self.shard_loads() if self.tp.world_size > 1 else {}, generator, std)


def build_model(
    arch: ModelArch,
    device: torch.device,
    dtype: torch.dtype,
    max_position: int,
    tp: TPGroup = _SINGLE,
    quant: QuantConfig | None = None,
) -> LlamaForCausalLM:
    """Allocate the model (this rank's share of it under ``tp``) directly on ``device``: no
    CPU copy, no random init.

    Weights are uninitialised (``torch.empty``) until ``load_weights`` or a dummy initialiser
    fills them; norm weights start at 1. The rotary table covers ``[0, max_position)``.
    ``tp`` defaults to ``TPGroup.single()``; an impossible split raises ``ValueError`` naming
    ``--tensor-parallel-size`` before anything is allocated. ``quant``: the weight scheme of
    the decoder's linear layers (None: unquantized); call ``process_weights_after_loading``
    once the weights are in.
    """
    arch.check_tensor_parallel(tp.world_size)
    with torch.device(device):
        model = LlamaForCausalLM(arch, max_position, dtype, tp, quant)
    return model.eval()
