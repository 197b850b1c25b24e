"""``tokenwire bench embed``: embedding throughput (sequences/s) of tokenwire's offline engine
against sentence-transformers' ``encode`` on the same texts, in the same run (issue 31).

Two random models are built here from transformers config classes and saved as
sentence-transformers directories (``modules.json``, ``1_Pooling``, ``2_Normalize``): a BERT
encoder of all-MiniLM-L6's shape (6 layers, 384 hidden, 12 heads, MEAN pooling, ~22M
parameters) and a Qwen3 decoder embedding model (LAST pooling; 6 layers, 384 hidden by
default). The texts are random words of a generated WordPiece vocabulary, one token per
word, ``--seq-len`` tokens each. Both sides get texts (tokenization included), float32 on the
CPU, batches of ``--batch-size``. Without sentence-transformers installed the baseline is
transformers' ``AutoModel`` with the same pooling. Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tokenwire.bench.configs import EMBED_MAX_MODEL_LEN as MAX_MODEL_LEN
from tokenwire.bench.configs import EmbedBenchConfig

MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
QWEN3 = dict(
    hidden_size=384,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1024,
)


def _write_model(kind: str, folder: Path, vocab_size: int, seed: int) -> None:
    import transformers
    from transformers import AutoConfig, AutoModel

    tokenizer_class: Any = getattr(transformers, "BertTokenizerFast")  # noqa: B009 (lazy export)

    words = [f"w{i}" for i in range(vocab_size - 5)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer_class(vocab=str(folder / "vocab.txt")).save_pretrained(folder)
    if kind == "bert":
        config = AutoConfig.for_model("bert", vocab_size=len(vocab), **MINILM)
        config.architectures = ["BertModel"]
    else:
        config = AutoConfig.for_model(
            "qwen3", vocab_size=len(vocab), tie_word_embeddings=True, pad_token_id=0, **QWEN3
        )
        config.architectures = ["Qwen3Model"]
    torch.manual_seed(seed)
    AutoModel.from_config(config, dtype=torch.float32).save_pretrained(folder)
    _write_st_files(folder, config.hidden_size, "mean_tokens" if kind == "bert" else "lasttoken")


def _write_st_files(folder: Path, hidden_size: int, pooling: str) -> None:
    """sentence-transformers' files: Transformer -> Pooling -> Normalize."""
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling_config = {"word_embedding_dimension": hidden_size, f"pooling_mode_{pooling}": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    (folder / "2_Normalize").mkdir(exist_ok=True)


def _texts(config: EmbedBenchConfig) -> list[str]:
    rng = random.Random(config.seed)
    n_words = config.seq_len - 2  # [CLS] ... [SEP]
    return [
        " ".join(f"w{rng.randrange(config.vocab_size - 5)}" for _ in range(n_words))
        for _ in range(config.num_sequences)
    ]


def _tokenwire(folder: Path, texts: list[str], config: EmbedBenchConfig) -> tuple[float, Any]:
    from tokenwire.runtime.llm import LLM

    tokens = config.batch_size * config.seq_len
    llm = LLM(
        str(folder),
        max_num_seqs=config.batch_size,
        max_num_batched_tokens=tokens,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=256 << 20,
    )
    try:
        llm.embed(texts[: config.batch_size], use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        out = llm.embed(texts, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return elapsed, torch.tensor([o.outputs.embedding for o in out])


def _baseline(folder: Path, texts: list[str], config: EmbedBenchConfig) -> tuple[float, Any, str]:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return (*_transformers_baseline(folder, texts, config), "transformers")
    st = SentenceTransformer(str(folder), device="cpu")
    st.encode(texts[: config.batch_size], batch_size=config.batch_size)  # warm-up
    t0 = time.perf_counter()
    out = st.encode(texts, batch_size=config.batch_size, convert_to_tensor=True)
    return time.perf_counter() - t0, out, "sentence-transformers"


@torch.inference_mode()
def _transformers_baseline(
    folder: Path, texts: list[str], config: EmbedBenchConfig
) -> tuple[float, Any]:
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    mean = "bert" in folder.name
    t0 = time.perf_counter()
    vectors = []
    for start in range(0, len(texts), config.batch_size):
        chunk = texts[start : start + config.batch_size]
        batch = tokenizer(chunk, padding=True, return_tensors="pt")
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].float()
        pooled = (hidden * mask).sum(1) / mask.sum(1) if mean else hidden[:, -1]
        vectors.append(torch.nn.functional.normalize(pooled, dim=-1))
    return time.perf_counter() - t0, torch.cat(vectors)


def run_embed_bench(config: EmbedBenchConfig) -> int:
    texts = _texts(config)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tokenwire-bench-embed-") as tmp:
        for kind in config.models:
            folder = Path(tmp) / kind
            _write_model(kind, folder, config.vocab_size, config.seed)
            params = sum(t.numel() for t in _state(folder))
            tw_s, tw_vecs = _tokenwire(folder, texts, config)
            base_s, base_vecs, baseline = _baseline(folder, texts, config)
            cosine = torch.nn.functional.cosine_similarity(tw_vecs, base_vecs.float().cpu()).min()
            rows.append(
                {
                    "model": kind,
                    "params_m": round(params / 1e6, 1),
                    "tokenwire_seq_s": round(len(texts) / tw_s, 1),
                    "baseline_seq_s": round(len(texts) / base_s, 1),
                    "speedup": round(base_s / tw_s, 2),
                    "min_cosine": round(float(cosine), 6),
                    "baseline": baseline,
                }
            )
    _print(rows, config)
    return 0


def _state(folder: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return [t for f in folder.glob("*.safetensors") for t in load_file(str(f)).values()]


def _print(rows: list[dict[str, Any]], config: EmbedBenchConfig) -> None:
    print(
        f"embeddings, CPU float32, {config.num_sequences} sequences x {config.seq_len} tokens, "
        f"batch {config.batch_size}, torch threads {torch.get_num_threads()}"
    )
    head = ("model", "params", "tokenwire seq/s", "baseline seq/s", "speed-up", "min cos")
    print(f"{head[0]:<8}" + "".join(f"{h:>17}" for h in head[1:]) + "  baseline")
    for r in rows:
        cells = (f"{r['params_m']}M", r["tokenwire_seq_s"], r["baseline_seq_s"],
                 f"{r['speedup']}x", r["min_cosine"])  # fmt: skip
        print(f"{r['model']:<8}" + "".join(f"{c:>17}" for c in cells) + f"  {r['baseline']}")
    print(json.dumps({
        "bench": "embed", "device": "cpu", "dtype": "float32",
        "num_sequences": config.num_sequences, "seq_len": config.seq_len,
        "batch_size": config.batch_size, "results": rows,
    }))  # fmt: skip
