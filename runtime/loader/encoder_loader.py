"""Load a BERT-family encoder (HF ``BertModel`` / ``BertForMaskedLM`` directory) for
embeddings: weights by name from safetensors, the tokenizer, the pooler from the
sentence-transformers files (``pooling_config``). ``--load-format dummy``: random weights.

The engine core sees the encoder through the same ``ModelFacts`` as a decoder, so its
``ModelArch`` is filled with the encoder's shapes (no rope, no KV heads of its own: the
core keeps KV *bookkeeping* blocks for admission, no KV tensors exist).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.front.tokenizer import Tokenizer, load_tokenizer
from tokenwire.runtime.loader.hub import resolve_tokenizer_dir
from tokenwire.runtime.loader.pooling_config import embed_spec, is_cross_encoder, is_encoder
from tokenwire.runtime.loader.source import model_source
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.bert import BertModel, BertShape
from tokenwire.runtime.models.bert_classifier import BertForSequenceClassification, ClassifierHead
from tokenwire.runtime.pooling_params import EmbedSpec, ResolvedPooler

_DEFAULT_INIT_STD = 0.02


@dataclass(frozen=True)
class LoadedEncoder:
    """The fields ``Worker.facts`` reads, as ``LoadedModel`` has them."""

    model: BertModel | BertForSequenceClassification  # the latter: a cross-encoder (score)
    arch: ModelArch
    shape: BertShape
    model_path: Path
    tokenizer: Tokenizer | None
    tokenizer_dir: Path | None
    max_model_len: int
    served_model_name: str
    device: torch.device
    dtype: torch.dtype
    embed: EmbedSpec
    eos_token_ids: frozenset[int] = frozenset()
    quantization: str | None = None


def source_is_encoder(model_config: ModelConfig) -> bool:
    """Whether the configured model is an encoder checkpoint (read config.json only)."""
    if model_config.model is None:
        return False
    source = model_source(model_config)
    config: dict[str, Any] = json.loads(source.config_file.read_text())
    return is_encoder(config)


def encoder_arch(shape: BertShape, architecture: str) -> ModelArch:
    heads = shape.num_attention_heads
    return ModelArch(
        architecture=architecture,
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=shape.hidden_size // heads,
        rms_norm_eps=shape.layer_norm_eps,
        rope_theta=0.0,
        rope_scaling=None,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        attention_bias=True,
        o_proj_bias=True,
        qk_norm=False,
        sliding_window=None,
        bos_token_id=None,
        eos_token_ids=(),
        hidden_act=shape.hidden_act,
    )


def load_encoder(
    model_config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> LoadedEncoder:
    if model_config.quantization is not None:
        raise ValueError("quantization: not supported for encoder models")
    source = model_source(model_config)
    folder = source.folder
    config: dict[str, Any] = json.loads(source.config_file.read_text())
    scores = _check_task(model_config.task, config)
    shape = BertShape.from_hf_config(config)
    architecture = str((config.get("architectures") or ["BertModel"])[0])
    limit = shape.max_position_embeddings - shape.position_offset
    max_model_len = model_config.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's context length "
            f"(max_position_embeddings={limit})"
        )
    model: BertModel | BertForSequenceClassification = (
        BertForSequenceClassification(shape, ClassifierHead.from_hf_config(config), dtype)
        if scores
        else BertModel(shape, dtype)
    ).to(device)
    if model_config.load_format == "dummy":
        std = float(config.get("initializer_range") or _DEFAULT_INIT_STD)
        model.init_random_weights(
            torch.Generator(device=device).manual_seed(model_config.seed), std
        )
    else:
        model.load_weights(_read_safetensors(folder))
    tokenizer_dir = resolve_tokenizer_dir(model_config, folder)
    tokenizer = load_tokenizer(tokenizer_dir)
    return LoadedEncoder(
        model=model.eval(),
        arch=encoder_arch(shape, architecture),
        shape=shape,
        model_path=folder,
        tokenizer=tokenizer,
        tokenizer_dir=None if tokenizer is None else tokenizer_dir,
        max_model_len=max_model_len,
        served_model_name=model_config.served_model_name or source.served_name,
        device=device,
        dtype=dtype,
        embed=_spec(folder, config, model_config, shape.hidden_size, scores),
    )


def _check_task(task: str, config: dict[str, Any]) -> bool:
    """Whether the encoder serves scores (a cross-encoder); ValueError for a task it does
    not serve."""
    arch = str((config.get("architectures") or ["BertModel"])[0])
    scores = is_cross_encoder(config)
    if task == "generate" or (task == "embed" and scores) or (task == "score" and not scores):
        served = (
            "text-pair scores only (--task score)" if scores else "embeddings only (--task embed)"
        )
        raise ValueError(f"task: {arch} is an encoder: it serves {served}")
    return scores


def _spec(
    folder: Path, config: dict[str, Any], model_config: ModelConfig, hidden: int, scores: bool
) -> EmbedSpec:
    if scores:  # the classifier head pools (CLS -> dense + tanh); no vector is returned
        return EmbedSpec(ResolvedPooler("CLS", False), hidden, False, cross_encoder=True)
    return embed_spec(folder, config, model_config.pooler_config, hidden)


def _read_safetensors(folder: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {folder}")
    out: list[tuple[str, torch.Tensor]] = []
    for file in files:
        out.extend(load_file(str(file)).items())
    return out
