"""One Llama-style causal LM covering Llama 2/3, SmolLM, Mistral, Qwen2/2.5, Qwen3, Gemma 2,
Gemma 3 (text), Phi-3/3.5 and the MoE families (Mixtral, Qwen MoE, gpt-oss, Llama 4); every family
difference is a ``ModelArch`` field (the decoder layer itself is in ``decoder``).

Tokens are flattened (no batch dimension): a step's sequences are concatenated into ``T``
rows and ``AttentionMetadata`` says which rows belong to which sequence and where their K/V
lives in the paged cache. Projections are fused (``qkv_proj``, ``gate_up_proj``) so each layer
runs four matmuls; ``load_weights`` maps HF parameter names into the fused tensors (and splits
checkpoints that store them fused, like Phi-3's). Gemma scales the embeddings and soft-caps
the final logits; Gemma 3's sliding-window layers rotate with their own rope base.

Tensor parallelism: built with a ``TPGroup`` of N ranks, each rank's model holds its share of
every projection (``layers.parallel``: heads for q/k/v, rows of the vocabulary, halves of the
MLP) and its forward all-reduces after ``o_proj`` and ``down_proj`` (and the embedding);
``compute_logits`` gathers the full vocabulary on every rank. ``load_weights`` reads only this
rank's slices of each checkpoint tensor. With ``TPGroup.single()`` (the default) the model is
exactly the single-device one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.bf16_logits import Bf16LogitsWeight, prepare_bf16_logits
from tokenwire.kernels.fused_layers import fused_layers
from tokenwire.kernels.int8_logits import Int8LogitsWeight, prepare_int8_logits
from tokenwire.kernels.invariant_linear import InvariantLinearWeight, prepare_invariant_linear
from tokenwire.kernels.rotary import (
    build_cos_sin_cache,
    compute_inv_freq,
    rope_attention_scaling,
)
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.decoder import DecoderLayer, KVCache, norm
from tokenwire.runtime.models.deepseek_checkpoint import deepseek_tensors
from tokenwire.runtime.models.fused_checkpoint import split_fused_projections
from tokenwire.runtime.models.fused_stack import (
    FusedModel,
    StackParts,
    build_fused_stack,
    fused_stack_reason,
)
from tokenwire.runtime.models.gpt_oss_checkpoint import split_gpt_oss_experts
from tokenwire.runtime.models.layers import (
    ParallelLMHead,
    QuantConfig,
    ShardedModule,
    ShardLoads,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from tokenwire.runtime.models.layers.basic import GemmaRMSNorm
from tokenwire.runtime.models.layers.quant.base import MethodFor, no_quantization
from tokenwire.runtime.models.llama4_checkpoint import llama4_tensors
from tokenwire.runtime.models.loading import init_random, load_checkpoint
from tokenwire.runtime.models.weights import ShardLoad, WeightSource, replicated

__all__ = [
    "DecoderLayer", "KVCache", "LlamaForCausalLM", "LlamaModel", "LogitsKind", "build_model",
]  # fmt: skip

# The LM head's prepared copy (``--lm-head-dtype`` resolved by the loader).
LogitsKind = Literal["float32", "bfloat16", "int8"]
LogitsWeight = InvariantLinearWeight | Bf16LogitsWeight | Int8LogitsWeight

_SINGLE = TPGroup.single()  # immutable: the default group of one


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (HF's ``model.*`` parameter prefix)."""

    def __init__(
        self, arch: ModelArch, dtype: torch.dtype, tp: TPGroup, methods: MethodFor
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, dtype, tp, methods) for i in range(arch.num_hidden_layers)
        )
        self.norm = norm(arch, arch.hidden_size, dtype)
        # Gemma: HF multiplies by sqrt(hidden) rounded to the model dtype.
        self.embed_scale: float | None = None
        if arch.embed_scale is not None:
            self.embed_scale = float(torch.tensor(arch.embed_scale).to(dtype))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        return hidden if self.embed_scale is None else hidden * self.embed_scale


def rope_cache(
    arch: ModelArch,
    theta: float,
    scaling: dict[str, Any] | None,
    max_position: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[max_position, rope_dim] rotary table (layout owned by ``kernels.rotary``)."""
    inv_freq = compute_inv_freq(arch.rope_dim, theta, scaling, max_position)
    return build_cos_sin_cache(inv_freq, max_position, dtype, rope_attention_scaling(scaling))


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
        methods = no_quantization if quant is None else quant.method_for()
        self.model = LlamaModel(arch, dtype, tp, methods)
        # Tied models have no lm_head parameter: logits use the embedding matrix itself (under
        # TP, this rank's rows of it), so the tie cannot be broken by device moves or loading.
        self.lm_head: ParallelLMHead | None = None
        if not arch.tie_word_embeddings:
            self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, dtype, tp)
        # [max_position, head_dim] rotary tables in the model dtype (layout owned by
        # kernels.rotary); buffers so they follow ``.to(device)``, not saved in checkpoints.
        # The local table (Gemma 3's sliding-window layers) exists only when a layer uses it.
        self.cos_sin_cache: torch.Tensor
        self.local_cos_sin_cache: torch.Tensor | None
        cache = rope_cache(arch, arch.rope_theta, arch.rope_scaling_dict(), max_position, dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.local_rope = tuple(map(arch.layer_uses_local_rope, range(arch.num_hidden_layers)))
        local = None
        if arch.sliding_rope_theta is not None and any(self.local_rope):
            local = rope_cache(arch, arch.sliding_rope_theta, None, max_position, dtype)
        self.register_buffer("local_cos_sin_cache", local, persistent=False)

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

    def prepare_logits(self, kind: LogitsKind = "float32") -> None:
        """After loading: the LM head reordered for ``kernels.invariant_linear`` (or a bf16
        copy for ``kernels.bf16_logits``, or int8 codes for ``kernels.int8_logits``), so a
        row's logits do not depend on how many rows the step computes (the loader calls it)."""
        weight = self.lm_head_weight
        prepared: LogitsWeight = prepare_invariant_linear(weight)
        if kind == "bfloat16":
            prepared = prepare_bf16_logits(weight)
        elif kind == "int8":
            prepared = prepare_int8_logits(weight)
        object.__setattr__(self, "_logits_weight", prepared)

    @property
    def logits_weight(self) -> LogitsWeight:
        """The LM head as ``compute_logits`` multiplies by it: plain until ``prepare_logits``,
        prepared again if the weight was edited in place since (the tie holds)."""
        prepared = self.__dict__.get("_logits_weight")
        if not isinstance(prepared, InvariantLinearWeight | Bf16LogitsWeight | Int8LogitsWeight):
            return InvariantLinearWeight(self.lm_head_weight, None)
        if not prepared.is_current(self.lm_head_weight):
            kinds: dict[type, LogitsKind] = {Bf16LogitsWeight: "bfloat16", Int8LogitsWeight: "int8"}
            self.prepare_logits(kinds.get(type(prepared), "float32"))
            prepared = self.__dict__["_logits_weight"]
        return prepared

    def prepare_fused_stack(self) -> str | None:
        """After loading: run the decoder stack as one operator (``kernels.fused_layers``)
        where the model allows it; returns why not (the loader logs it), None when it does."""
        reason = fused_stack_reason(self.stack_parts())
        object.__setattr__(
            self, "_fused", None if reason else build_fused_stack(self.stack_parts())
        )
        return reason

    def stack_parts(self) -> StackParts:
        """What ``runtime.models.fused_stack`` reads to choose and build the fused stack."""
        return StackParts(
            self.arch, self.model.layers, self.model.norm, self.tp.world_size,
            self.cos_sin_cache.dtype, any(self.local_rope),
        )  # fmt: skip

    def _fused_forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache | None],
        meta: AttentionMetadata | None,
    ) -> torch.Tensor | None:
        """The stack as one operator, when prepared and still applicable (float32 caches, no
        LoRA wrappers since); None: run the torch layers."""
        fused = self.__dict__.get("_fused")
        if not isinstance(fused, FusedModel) or meta is None or kv_caches[0] is None:
            return None
        if meta.image_spans:  # Gemma 3's both-ways image attention: the torch layers
            return None
        if kv_caches[0][0].dtype != torch.float32 or not fused.current(self.model.layers):
            return None
        caches = [t for kv in kv_caches if kv is not None for t in kv[:2]]
        return fused_layers(hidden, positions, meta, caches, self.cos_sin_cache, fused.stack)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache | None],
        meta: AttentionMetadata | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final-normed hidden states [T, hidden].

        ``meta`` None (with ``None`` caches): every layer attends through its
        ``external_attention`` (a compiled forward, ``worker.cpu_compile``).
        ``inputs_embeds`` [T, hidden]: the step's input embeddings, already made (image
        features over placeholder rows, ``models.llava``); None: ``embed(input_ids)``."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} KV caches, got {len(kv_caches)}")
        hidden = self.model.embed(input_ids) if inputs_embeds is None else inputs_embeds
        fused = self._fused_forward(hidden, positions, kv_caches, meta)
        if fused is not None:
            return fused
        residual: torch.Tensor | None = None
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            rope = self.cos_sin_cache
            if self.local_rope[i] and self.local_cos_sin_cache is not None:
                rope = self.local_cos_sin_cache
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, rope)
        if residual is None:  # zero-layer model
            residual = torch.zeros_like(hidden)
        normed, _ = self.model.norm.add_and_norm(hidden, residual)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab].

        Under TP a collective (the vocab shards are all-gathered): every rank must call it
        with the same N, in the same order, and every rank gets bitwise-identical logits.
        Gemma's final soft-cap (``cap * tanh(logits / cap)``) runs in float32 after the gather.
        """
        logits = vocab_parallel_logits(hidden, self.logits_weight, self.arch.vocab_size, self.tp)
        cap = self.arch.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

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
        if self.arch.fused_checkpoint_projections:
            weights = split_fused_projections(weights, self.arch)
        if self.arch.architecture == "GptOssForCausalLM":
            weights = split_gpt_oss_experts(weights, self)
        if self.arch.interleaved_rope_checkpoint:  # Llama 4
            weights = llama4_tensors(weights, self.arch)
        if self.arch.mla is not None:  # DeepSeek-V2/V3
            weights = deepseek_tensors(weights, self.arch)
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
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.weight.zero_()  # stored offsets: scale 1, as HF initialises them


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
