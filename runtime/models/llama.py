"""One Llama-style decoder covering Llama 2/3, SmolLM, Mistral, Qwen2/2.5 and Qwen3.

Tokens are flattened (no batch dimension): a step's sequences are concatenated into ``T``
rows and ``AttentionMetadata`` says which rows belong to which sequence and where their K/V
lives in the paged cache. Projections are fused (``qkv_proj``, ``gate_up_proj``) so each layer
runs four matmuls; ``load_weights`` maps HF parameter names into the fused tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenwire.kernels.activation import silu_and_mul
from tokenwire.kernels.attention_metadata import AttentionMetadata
from tokenwire.kernels.paged_attention import paged_attention
from tokenwire.kernels.rotary import apply_rotary, build_cos_sin_cache, compute_inv_freq
from tokenwire.kernels.store_kv import store_kv
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.layers import Embedding, Linear, RMSNorm

# One layer's paged KV cache: (k_cache, v_cache), each [num_blocks, block_size, Hkv, D].
KVCache = tuple[torch.Tensor, torch.Tensor]

# HF checkpoint projection -> (fused parameter, shard id). Shard order inside the fused
# tensor is q, k, v and gate, up (silu_and_mul expects gate first).
_STACKED_PARAMS: tuple[tuple[str, str, str], ...] = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", "gate"),
    ("up_proj", "gate_up_proj", "up"),
)
_FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q", "k", "v"),
    "gate_up_proj": ("gate", "up"),
}


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.q_size
        self.kv_size = arch.kv_size
        self.scale = arch.head_dim**-0.5
        qkv_out = arch.q_size + 2 * arch.kv_size
        self.qkv_proj = Linear(arch.hidden_size, qkv_out, arch.attention_bias, dtype)
        self.o_proj = Linear(arch.q_size, arch.hidden_size, arch.o_proj_bias, dtype)
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
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        result: torch.Tensor = self.o_proj(out.reshape(num_tokens, self.q_size))
        return result


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        inter = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * inter, False, dtype)
        self.down_proj = Linear(inter, arch.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return result


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(arch, dtype)
        self.mlp = MLP(arch, dtype)
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

    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, dtype) for _ in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Flattened-token causal LM. Build it with ``build_model``, then load weights."""

    def __init__(self, arch: ModelArch, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        self.max_position = max_position
        self.model = LlamaModel(arch, dtype)
        # Tied models have no lm_head parameter: logits use the embedding matrix itself, so
        # the tie cannot be broken by device moves or weight loading.
        self.lm_head: Linear | None = None
        if not arch.tie_word_embeddings:
            self.lm_head = Linear(arch.hidden_size, arch.vocab_size, False, dtype)
        # [max_position, head_dim] rotary table in the model dtype (layout owned by
        # kernels.rotary); a buffer so it follows ``.to(device)``, not saved in checkpoints.
        inv_freq = compute_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling_dict())
        self.cos_sin_cache: torch.Tensor
        self.register_buffer(
            "cos_sin_cache", build_cos_sin_cache(inv_freq, max_position, dtype), persistent=False
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden]; the embedding matrix itself when embeddings are tied."""
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
        """[N, hidden] -> float32 logits [N, vocab]."""
        return torch.nn.functional.linear(hidden, self.lm_head_weight).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into this model's (fused) parameters.

        Raises ValueError on an unknown name, a shape mismatch, or a parameter (or fused
        shard) that the checkpoint never provided.
        """
        params = dict(self.named_parameters())
        loaded: dict[str, set[str]] = {name: set() for name in params}
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store a copy of the embedding
            name, shard = _map_name(hf_name)
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.arch.architecture}")
            _copy_shard(params[name], name, shard, tensor, self._shard_sizes(name))
            loaded[name].add(shard)
        missing = [
            name
            for name, shards in loaded.items()
            if shards != set(_FUSED_SHARDS.get(_fused_kind(name), ("",)))
        ]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(sorted(missing))}")

    def _shard_sizes(self, name: str) -> dict[str, int]:
        """Rows per shard (dim 0) of a fused parameter, in storage order."""
        kind = _fused_kind(name)
        if kind == "qkv_proj":
            return {"q": self.arch.q_size, "k": self.arch.kv_size, "v": self.arch.kv_size}
        if kind == "gate_up_proj":
            inter = self.arch.intermediate_size
            return {"gate": inter, "up": inter}
        return {}


def _fused_kind(param_name: str) -> str:
    for kind in _FUSED_SHARDS:
        if f".{kind}." in param_name:
            return kind
    return ""


def _map_name(hf_name: str) -> tuple[str, str]:
    """HF parameter name -> (our parameter name, shard id; "" when not fused)."""
    for src, dst, shard in _STACKED_PARAMS:
        if f".{src}." in hf_name:
            return hf_name.replace(f".{src}.", f".{dst}."), shard
    return hf_name, ""


def _copy_shard(
    param: torch.Tensor, name: str, shard: str, tensor: torch.Tensor, sizes: dict[str, int]
) -> None:
    target = param
    if shard:
        offset = 0
        for key, rows in sizes.items():
            if key == shard:
                break
            offset += rows
        target = param.narrow(0, offset, sizes[shard])
    if target.shape != tensor.shape:
        raise ValueError(
            f"shape mismatch for {name}[{shard or 'all'}]: "
            f"checkpoint {tuple(tensor.shape)}, model {tuple(target.shape)}"
        )
    target.copy_(tensor)


def build_model(
    arch: ModelArch, device: torch.device, dtype: torch.dtype, max_position: int
) -> LlamaForCausalLM:
    """Allocate the model directly on ``device``: no CPU copy, no random init.

    Weights are uninitialised (``torch.empty``) until ``load_weights`` or a dummy initialiser
    fills them; norm weights start at 1. The rotary table covers ``[0, max_position)``.
    """
    with torch.device(device):
        model = LlamaForCausalLM(arch, max_position, dtype)
    return model.eval()
