"""Tiny random embedding models saved as sentence-transformers directories (no network).

``build_st_model(kind, out_dir, pooling)``: a random ``Qwen3Model`` decoder (``kind="qwen3"``)
or ``BertModel`` encoder (``kind="bert"``) from transformers config classes, with a small
WordPiece tokenizer written here, wrapped as ``Transformer -> Pooling -> Normalize`` by
sentence-transformers itself and saved (modules.json, 1_Pooling/config.json, ...). The
returned ``SentenceTransformer`` is the reference tokenwire's vectors are compared with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

WORDS: tuple[str, ...] = tuple(
    " ".join(
        (
            "the quick brown fox jumps over lazy dog hello world tokenwire embeds text into",
            "vectors retrieval augmented generation needs good embeddings for every query and",
            "document a model of sentences paris is capital france what where when why how many",
        )
    ).split()
)

# MiniLM-L6 shape (6 layers, 384 hidden, 12 heads) for the throughput figure.
MINILM_SHAPE: dict[str, Any] = dict(
    hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536
)
TINY_BERT: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
)
TINY_QWEN3: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
)


def write_tokenizer(folder: Path) -> Any:
    """A WordPiece tokenizer over ``WORDS`` (lower-casing, [CLS] ... [SEP])."""
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = list(
        dict.fromkeys(specials + sorted(set(WORDS)) + letters + [f"##{c}" for c in letters])
    )
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(folder / "vocab.txt"), do_lower_case=True)
    assert len(tokenizer) == len(vocab), "the WordPiece vocabulary did not load"
    tokenizer.save_pretrained(folder)
    return tokenizer


def build_hf_model(kind: str, folder: Path, seed: int = 0, **shape: Any) -> Path:
    import torch
    from transformers import AutoConfig, AutoModel

    tokenizer = write_tokenizer(folder)
    base = TINY_BERT if kind == "bert" else TINY_QWEN3
    kwargs = {**base, **shape}
    if kind == "bert":
        config = AutoConfig.for_model(
            "bert", vocab_size=len(tokenizer), max_position_embeddings=128, **kwargs
        )
        config.architectures = ["BertModel"]
    else:
        config = AutoConfig.for_model(
            "qwen3",
            vocab_size=len(tokenizer),
            max_position_embeddings=256,
            tie_word_embeddings=True,
            pad_token_id=0,
            eos_token_id=3,
            is_matryoshka=True,
            **kwargs,
        )
        config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModel.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # larger than HF's init: pooled vectors differ clearly
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    model.eval().save_pretrained(folder, safe_serialization=True)
    return folder


def build_st_model(kind: str, out_dir: Path, pooling: str, seed: int = 0, **shape: Any) -> Any:
    """Save a sentence-transformers model at ``out_dir``; returns it (the reference)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    build_hf_model(kind, out_dir, seed, **shape)
    transformer = models.Transformer(str(out_dir))
    dim = transformer.get_embedding_dimension()
    modules = [transformer, models.Pooling(dim, pooling_mode=pooling), models.Normalize()]
    st = SentenceTransformer(modules=modules, device="cpu")
    st.save(str(out_dir))
    return st
