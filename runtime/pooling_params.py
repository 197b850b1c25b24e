"""Embedding (pooling) records: the model's pooler and one request's pooling options.

``PoolerConfig`` is model-level (vLLM's ``--pooler-config``): how the hidden states of a
prompt become one vector (``LAST`` token, ``MEAN`` over the prompt, ``CLS`` = the first
token) and whether it is L2-normalized. The loader reads it from the model's
sentence-transformers files (``modules.json`` + ``1_Pooling/config.json`` + a ``Normalize``
module); the flag overrides any key it names.

``PoolingParams`` is per request and rides on ``SamplingParams.pooling``: a request that
carries it is an embedding request (prefill only: it never samples, and finishes once its
last prompt chunk ran). ``dimensions`` keeps the first ``dimensions`` values (Matryoshka)
and renormalizes them when the pooler normalizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, get_args

from tokenwire.runtime.errors import ParameterError

PoolingType = Literal["LAST", "MEAN", "CLS"]
# What a model serves: generation (sampling), embeddings (pooling) or text-pair scores (a
# cross-encoder). ``auto`` picks score for ``*ForSequenceClassification`` encoders, embed for
# other encoder checkpoints (BertModel) and for directories with a sentence-transformers
# pooling module, else generate.
Task = Literal["auto", "generate", "embed", "score"]
TASKS: tuple[str, ...] = get_args(Task)


@dataclass(frozen=True)
class PoolerConfig:
    """``pooling_type`` / ``normalize``: None leaves the model's own choice (from its
    sentence-transformers config; without one: LAST + normalize for decoders, CLS +
    normalize for encoders)."""

    pooling_type: PoolingType | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in get_args(PoolingType):
            raise ValueError(
                "pooler_config: pooling_type must be one of LAST, MEAN, CLS; "
                f"got {self.pooling_type!r}"
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(
                f"pooler_config: normalize must be true or false, got {self.normalize!r}"
            )


@dataclass(frozen=True)
class ResolvedPooler:
    """The pooler a loaded embedding model runs (every choice made)."""

    pooling_type: PoolingType
    normalize: bool


@dataclass(frozen=True)
class EmbedSpec:
    """How a loaded embedding model pools, and which ``dimensions`` it accepts."""

    pooler: ResolvedPooler
    hidden_size: int
    is_matryoshka: bool
    matryoshka_dimensions: tuple[int, ...] = ()  # empty: any size up to ``hidden_size``
    # A cross-encoder (``--task score``): it scores text pairs, one float per pair.
    cross_encoder: bool = False

    @property
    def task(self) -> str:
        return "score" if self.cross_encoder else "embed"


def parse_pooler_config(text: str) -> PoolerConfig:
    """The ``--pooler-config`` JSON: ``{"pooling_type": "MEAN", "normalize": false}``."""
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"pooler_config must be a JSON object: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ValueError("pooler_config must be a JSON object")
    config = pooler_from_value(data)
    assert config is not None
    return config


def pooler_from_value(value: Any) -> PoolerConfig | None:
    """A ``PoolerConfig`` from the flag's JSON text, a dict (``LLM(pooler_config={...})``)
    or a ``PoolerConfig``; None stays None."""
    if value is None or isinstance(value, PoolerConfig):
        return value
    if isinstance(value, str):
        return parse_pooler_config(value)
    if not isinstance(value, dict):
        raise ValueError(f"pooler_config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"pooler_config: unknown key(s) {', '.join(unknown)}")
    kind = value.get("pooling_type")
    return PoolerConfig(
        pooling_type=None if kind is None else str(kind).upper(),  # type: ignore[arg-type]
        normalize=value.get("normalize"),
    )


@dataclass(frozen=True)
class PoolingParams:
    """One embedding request's options: ``dimensions`` (None: the full vector).
    ``pair_start``: a score request (cross-encoder): the prompt is a tokenized text pair
    whose second text (token type 1) starts at this index; None: an embedding request."""

    dimensions: int | None = None
    pair_start: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or self.dimensions < 1
        ):
            raise ParameterError("dimensions", f"must be a positive integer, got {self.dimensions}")
        if self.pair_start is not None and self.pair_start < 1:
            raise ParameterError("pair_start", f"must be >= 1, got {self.pair_start}")
