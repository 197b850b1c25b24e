"""A tiny random cross-encoder (``BertForSequenceClassification`` or
``XLMRobertaForSequenceClassification``, one label) saved with the
WordPiece tokenizer of ``embed_models`` (no network), and the reference scores for it:
transformers' own forward on the tokenizer's text pairs, then sigmoid (sentence-transformers'
``CrossEncoder`` default for one label)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embed_models import TINY_BERT, write_tokenizer

PAIRS: list[tuple[str, str]] = [
    ("what is the capital of france", "paris is the capital of france"),
    ("what is the capital of france", "the quick brown fox jumps over the lazy dog"),
    ("hello world", "tokenwire embeds text into vectors"),
    ("retrieval augmented generation", "good embeddings for every query and document"),
]


def build_cross_encoder(folder: Path, seed: int = 0, kind: str = "bert") -> Path:
    """``kind``: ``bert`` (BertForSequenceClassification) or ``xlm-roberta``
    (XLMRobertaForSequenceClassification: one token type, positions past pad id 0)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    tokenizer = write_tokenizer(folder)
    extra: dict[str, Any] = (
        {"type_vocab_size": 1, "pad_token_id": 0, "max_position_embeddings": 130}
        if kind == "xlm-roberta"
        else {"max_position_embeddings": 128}
    )
    config = AutoConfig.for_model(
        kind, vocab_size=len(tokenizer), num_labels=1, **extra, **TINY_BERT
    )
    arch = "XLMRoberta" if kind == "xlm-roberta" else "Bert"
    config.architectures = [f"{arch}ForSequenceClassification"]
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # larger than HF's init: scores differ clearly
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
        encoder = model.base_model
        encoder.embeddings.token_type_embeddings.weight.normal_(0.0, 1.0)
        encoder.embeddings.position_embeddings.weight.normal_(0.0, 1.0)
        for p in model.classifier.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    model.eval().save_pretrained(folder, safe_serialization=True)
    return folder


def reference_scores(
    folder: Path, pairs: list[tuple[str, str]], zero_types: bool = False
) -> list[float]:
    """``zero_types``: every token type 0 (what a pair run without its types would give)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    out: list[float] = []
    with torch.no_grad():
        for first, second in pairs:  # one at a time: no padding in the reference
            batch = tokenizer(first, second, return_tensors="pt")
            if zero_types:
                batch["token_type_ids"] = torch.zeros_like(batch["token_type_ids"])
            if model.config.type_vocab_size == 1:  # XLM-R: no segments
                batch.pop("token_type_ids")
            out.append(float(torch.sigmoid(model(**batch).logits[0, 0])))
    return out
