"""BERT-family encoder (HF ``BertModel`` / ``BertForMaskedLM`` weights): bidirectional
attention over a padded batch, absolute position + token type embeddings, post-norm
LayerNorm blocks, GELU MLP. Torch reference attention (``scaled_dot_product_attention`` with
a key-padding mask); no KV cache: an encoder request runs whole in one step.

Parameter names follow HF's ``BertModel`` (``embeddings.*``, ``encoder.layer.N.*``) so a
checkpoint loads by name; ``BertForMaskedLM``'s ``bert.`` prefix is stripped and its MLM head
(``cls.*``) and the pooler (``pooler.*``, unused by sentence-transformers) are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
_ROBERTA_TYPES = ("roberta", "xlm-roberta")


@dataclass(frozen=True)
class BertShape:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int
    # RoBERTa / XLM-R: positions start past the padding index (pad_token_id + 1); BERT: 0.
    position_offset: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("model: hidden_size must be a multiple of num_attention_heads")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"model: hidden_act {self.hidden_act!r} is not supported by the BERT encoder "
                f"({', '.join(_ACTIVATIONS)} are)"
            )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> BertShape:
        kind = cfg.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"model: position_embedding_type {kind!r} is not supported")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            hidden_act=str(cfg.get("hidden_act", "gelu")),
            pad_token_id=int(cfg.get("pad_token_id") or 0),
            position_offset=int(cfg.get("pad_token_id") or 0) + 1
            if cfg.get("model_type") in _ROBERTA_TYPES
            else 0,
        )


def _activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "relu":
        return F.relu(x)
    return F.gelu(x, approximate="none" if name == "gelu" else "tanh")


class _Embeddings(nn.Module):
    def __init__(self, shape: BertShape, dtype: torch.dtype) -> None:
        super().__init__()
        h = shape.hidden_size
        self.word_embeddings = nn.Embedding(shape.vocab_size, h, dtype=dtype)
        self.position_embeddings = nn.Embedding(shape.max_position_embeddings, h, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(shape.type_vocab_size, h, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(h, eps=shape.layer_norm_eps, dtype=dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # None: single-segment input, every token has type 0 (a text pair passes its types).
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        out: torch.Tensor = self.LayerNorm(x)
        return out


class _SelfAttention(nn.Module):
    def __init__(self, h: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.query = nn.Linear(h, h, dtype=dtype)
        self.key = nn.Linear(h, h, dtype=dtype)
        self.value = nn.Linear(h, h, dtype=dtype)


class _DenseNorm(nn.Module):
    """``dense`` then residual + ``LayerNorm`` (HF's ``BertSelfOutput`` / ``BertOutput``)."""

    def __init__(self, n_in: int, h: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(n_in, h, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(h, eps=eps, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.LayerNorm(self.dense(x) + residual)
        return out


class _Attention(nn.Module):
    def __init__(self, h: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.self = _SelfAttention(h, dtype)  # HF's name: attention.self.query ...
        self.output = _DenseNorm(h, h, eps, dtype)


class _Intermediate(nn.Module):
    def __init__(self, h: int, n: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(h, n, dtype=dtype)


class _Layer(nn.Module):
    """One post-norm block; submodule names mirror HF's (``attention.self.query`` ...)."""

    def __init__(self, shape: BertShape, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = shape.hidden_size, shape.layer_norm_eps
        self.heads = shape.num_attention_heads
        self.act = shape.hidden_act
        self.attention = _Attention(h, eps, dtype)
        self.intermediate = _Intermediate(h, shape.intermediate_size, dtype)
        self.output = _DenseNorm(shape.intermediate_size, h, eps, dtype)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        return x.view(b, n, self.heads, h // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        qkv = self.attention.self
        q, k, v = self._split(qkv.query(x)), self._split(qkv.key(x)), self._split(qkv.value(x))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        x = self.attention.output(ctx.transpose(1, 2).reshape(x.shape), x)
        out: torch.Tensor = self.output(_activation(self.act, self.intermediate.dense(x)), x)
        return out


class _Encoder(nn.Module):
    def __init__(self, shape: BertShape, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(shape, dtype) for _ in range(shape.num_hidden_layers))


class BertModel(nn.Module):
    def __init__(self, shape: BertShape, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = shape
        self.embeddings = _Embeddings(shape, dtype)
        self.encoder = _Encoder(shape, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids`` [B, L] (padded past each row's length), ``lengths`` [B],
        ``token_type_ids`` [B, L] (None: all 0) -> last hidden states [B, L, hidden]
        (padding rows hold garbage)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        valid = positions[None, :] < lengths[:, None]  # [B, L] real keys
        key_mask = valid[:, None, None, :]  # broadcast over heads and queries
        offset = self.shape.position_offset
        x: torch.Tensor = self.embeddings(input_ids, positions[None, :] + offset, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, key_mask)
        return x

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; ValueError naming a tensor that does not fit or a
        parameter the checkpoint never provided."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for raw_name, tensor in weights:
            name = raw_name.removeprefix("bert.").removeprefix("roberta.")
            if name.startswith(("cls.", "pooler.")) or name.endswith("position_ids"):
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"model: unexpected checkpoint tensor {raw_name!r}")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"model: checkpoint tensor {raw_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            param.copy_(tensor.to(param.dtype))
            seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            raise ValueError(f"model: checkpoint is missing {', '.join(missing[:5])}")

    @torch.no_grad()
    def init_random_weights(self, generator: torch.Generator, std: float) -> None:
        """``--load-format dummy``: N(0, std) matrices, zero biases, LayerNorm weights 1."""
        for name, param in self.named_parameters():
            if "LayerNorm" in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.copy_(
                    torch.randn(param.shape, generator=generator, device=param.device) * std
                )
