"""What an embedding checkpoint says about itself: task, pooler and Matryoshka dimensions.

Read from the model directory without sentence-transformers itself: ``modules.json`` lists
the modules (a ``Pooling`` module names its folder, e.g. ``1_Pooling``, whose
``config.json`` holds ``pooling_mode_*`` flags; a ``Normalize`` module means L2
normalization). ``--pooler-config`` overrides the pooling type and normalization.

Defaults without a sentence-transformers config (vLLM's): decoders pool the LAST token,
encoders the CLS token, both normalized. Matryoshka: config.json's ``matryoshka_dimensions``
(a list: only those sizes) or ``is_matryoshka: true`` (any size up to the hidden size).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenwire.runtime.models.arch import SUPPORTED_ARCHITECTURES
from tokenwire.runtime.pooling_params import EmbedSpec, PoolerConfig, PoolingType, ResolvedPooler

# HF architectures served as encoders (bidirectional attention, ``models.bert``).
ENCODER_ARCHITECTURES: tuple[str, ...] = (
    "BertModel",
    "BertForMaskedLM",
    "BertForSequenceClassification",
    "XLMRobertaForSequenceClassification",
)
# Cross-encoders (``--task score``): an encoder with a one-label classifier head.
CROSS_ENCODER_ARCHITECTURES: tuple[str, ...] = (
    "BertForSequenceClassification",
    "XLMRobertaForSequenceClassification",
)

# sentence-transformers pooling flags -> our pooling type (the supported ones).
_ST_MODES: dict[str, PoolingType] = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_ST_NAMES: dict[str, PoolingType] = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


def is_encoder(config: dict[str, Any]) -> bool:
    archs = config.get("architectures") or []
    if archs:
        return str(archs[0]) in ENCODER_ARCHITECTURES
    return config.get("model_type") == "bert"


def is_cross_encoder(config: dict[str, Any]) -> bool:
    archs = config.get("architectures") or []
    return bool(archs) and str(archs[0]) in CROSS_ENCODER_ARCHITECTURES


def base_decoder_config(config: dict[str, Any]) -> dict[str, Any]:
    """A bare decoder checkpoint (``Qwen3Model``, ``LlamaModel``, ``MistralModel``: what
    sentence-transformers saves) read as its ``*ForCausalLM`` family; others unchanged."""
    archs = config.get("architectures") or []
    if not archs or not str(archs[0]).endswith("Model") or is_encoder(config):
        return config
    causal = str(archs[0])[: -len("Model")] + "ForCausalLM"
    return {**config, "architectures": [causal]} if causal in SUPPORTED_ARCHITECTURES else config


def _is_bare_decoder(config: dict[str, Any]) -> bool:
    return base_decoder_config(config) is not config


def _read(path: Path) -> Any:
    return json.loads(path.read_text())


def _modules(folder: Path) -> list[dict[str, Any]]:
    path = folder / "modules.json"
    if not path.is_file():
        return []
    data = _read(path)
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []


def _module_kind(module: dict[str, Any]) -> str:
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def st_pooler(folder: Path) -> PoolerConfig | None:
    """The sentence-transformers pooler of ``folder``; None: the directory has none."""
    modules = _modules(folder)
    pooling = next((m for m in modules if _module_kind(m) == "Pooling"), None)
    if pooling is None:
        return None
    config_path = folder / str(pooling.get("path", "")) / "config.json"
    config: dict[str, Any] = _read(config_path) if config_path.is_file() else {}
    kind: PoolingType | None = None
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        kind = _ST_NAMES.get(mode.lower())
    for key, value in config.items():
        if key.startswith("pooling_mode_") and value:
            kind = _ST_MODES.get(key)
            if kind is None:
                raise ValueError(
                    f"the model's sentence-transformers pooling {key} is not supported "
                    "(LAST, MEAN, CLS are): set --pooler-config"
                )
    normalize = any(_module_kind(m) == "Normalize" for m in modules)
    return PoolerConfig(pooling_type=kind, normalize=normalize)


def resolve_task(task: str, folder: Path, config: dict[str, Any]) -> str:
    """``generate`` or ``embed`` for ``--task`` (``auto``: embed for encoders, bare
    decoders without an LM head (``Qwen3Model``) and directories with a sentence-transformers
    pooling module)."""
    if task == "score":  # cross-encoders load through encoder_loader; a decoder never scores
        raise ValueError(
            "task: score needs a cross-encoder (BertForSequenceClassification) checkpoint"
        )
    if task != "auto":
        if task == "generate" and is_encoder(config):
            raise ValueError(
                f"task: {config.get('architectures', ['this model'])[0]} is an encoder: it "
                "serves embeddings only (--task embed)"
            )
        return task
    if is_encoder(config) or _is_bare_decoder(config) or st_pooler(folder) is not None:
        return "embed"
    return "generate"


def embed_spec(
    folder: Path, config: dict[str, Any], override: PoolerConfig | None, hidden_size: int
) -> EmbedSpec:
    found = st_pooler(folder) or PoolerConfig()
    override = override or PoolerConfig()
    default: PoolingType = "CLS" if is_encoder(config) else "LAST"
    kind = override.pooling_type or found.pooling_type or default
    normalize = override.normalize
    if normalize is None:
        normalize = found.normalize if _modules(folder) else True
    dims = config.get("matryoshka_dimensions") or ()
    return EmbedSpec(
        pooler=ResolvedPooler(kind, bool(normalize)),
        hidden_size=hidden_size,
        is_matryoshka=bool(dims) or bool(config.get("is_matryoshka")),
        matryoshka_dimensions=tuple(int(d) for d in dims),
    )
