"""BERT cross-encoder (HF ``BertForSequenceClassification``): the ``BertModel`` encoder, its
pooler (``dense`` + tanh over the first token's state) and a linear ``classifier`` head.
``XLMRobertaForSequenceClassification`` is the same math (its head: ``classifier.dense`` +
tanh, ``classifier.out_proj``; positions offset past the padding index; one token type).

A cross-encoder scores a text pair (``--task score``): the pair runs as one sequence
(``[CLS] a [SEP] b [SEP]``, token type 1 on ``b``'s part) and its one logit, after the
model's activation (sigmoid by default for one label: what sentence-transformers'
``CrossEncoder`` and vLLM apply), is the score. Dropout is an inference no-op and absent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from tokenwire.runtime.models.bert import BertModel, BertShape

ScoreActivation = Literal["sigmoid", "identity"]
# ``CrossEncoder``'s saved activation (config.json) -> ours.
_ST_ACTIVATIONS: dict[str, ScoreActivation] = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
}


@dataclass(frozen=True)
class ClassifierHead:
    """The head of a sequence-classification checkpoint: its labels and score activation."""

    num_labels: int
    activation: ScoreActivation
    # Checkpoint names of (pooler dense, classifier): BERT's ``bert.pooler.dense`` +
    # ``classifier``, or XLM-R's ``classifier.dense`` + ``classifier.out_proj`` (same math).
    roberta: bool = False

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ClassifierHead:
        labels = cfg.get("id2label")
        num_labels = len(labels) if isinstance(labels, dict) else int(cfg.get("num_labels", 2))
        if num_labels != 1:
            raise ValueError(
                f"model: a cross-encoder for --task score has one label; this one has {num_labels}"
            )
        st = cfg.get("sentence_transformers")
        name = st.get("activation_fn") if isinstance(st, dict) else None
        name = name or cfg.get("sbert_ce_default_activation_function")
        roberta = cfg.get("model_type") in ("roberta", "xlm-roberta")
        if name is None:
            return cls(num_labels, "sigmoid", roberta)
        activation = _ST_ACTIVATIONS.get(str(name))
        if activation is None:
            raise ValueError(f"model: score activation {name!r} is not supported")
        return cls(num_labels, activation, roberta)


class BertForSequenceClassification(nn.Module):
    def __init__(self, shape: BertShape, head: ClassifierHead, dtype: torch.dtype) -> None:
        super().__init__()
        h = shape.hidden_size
        self.shape = shape
        self.head = head
        self.bert = BertModel(shape, dtype)
        self.pooler_dense = nn.Linear(h, h, dtype=dtype)  # HF: bert.pooler.dense
        self.classifier = nn.Linear(h, head.num_labels, dtype=dtype)

    def forward(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        """[B, L] ids / types, [B] lengths -> [B, num_labels] float32 scores (activated)."""
        hidden = self.bert(input_ids, lengths, token_type_ids)
        pooled = torch.tanh(self.pooler_dense(hidden[:, 0]))
        logits = self.classifier(pooled).float()
        return torch.sigmoid(logits) if self.head.activation == "sigmoid" else logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names: ``bert.*`` / ``roberta.*`` go to the encoder, the head's (``ClassifierHead``)
        to the head. ValueError naming a missing or misfit tensor."""
        dense, out = (
            ("classifier.dense", "classifier.out_proj")
            if self.head.roberta
            else ("bert.pooler.dense", "classifier")
        )
        head = {
            f"{dense}.weight": self.pooler_dense.weight,
            f"{dense}.bias": self.pooler_dense.bias,
            f"{out}.weight": self.classifier.weight,
            f"{out}.bias": self.classifier.bias,
        }
        seen: set[str] = set()
        encoder: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            param = head.get(name)
            if param is None:
                encoder.append((name, tensor))
                continue
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"model: checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            param.copy_(tensor.to(param.dtype))
            seen.add(name)
        missing = sorted(set(head) - seen)
        if missing:
            raise ValueError(f"model: checkpoint is missing {', '.join(missing)}")
        self.bert.load_weights(encoder)

    @torch.no_grad()
    def init_random_weights(self, generator: torch.Generator, std: float) -> None:
        """``--load-format dummy``: the encoder's scheme; head matrices N(0, std), biases 0."""
        self.bert.init_random_weights(generator, std)
        for linear in (self.pooler_dense, self.classifier):
            linear.bias.zero_()
            linear.weight.copy_(
                torch.randn(linear.weight.shape, generator=generator, device=linear.weight.device)
                * std
            )
