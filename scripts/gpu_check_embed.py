"""The ``embed`` stage of ``gpu_check.py`` (issue 34): a decoder embedding model's throughput
next to HF transformers' in the same run, and a check that the two agree.

The bundled ``qwen3-0.6b`` config read as a bare ``Qwen3Model`` (Qwen3-Embedding-0.6B's
shape: what tokenwire serves as an embedding model, LAST-token pooling, L2-normalized) gets
random bf16 weights from transformers' ``AutoModel.from_config`` on the device, saved as
safetensors, so both sides run the very same weights. Two records:

- ``embed_throughput``: ``--embed-requests`` (1024) inputs of ``--embed-tokens`` (256) token
  ids each, all at once through ``LLM.embed``, against ``AutoModel``'s forward over batches of
  ``--embed-batch`` (64) with the same pooling (the last position; the inputs have one length,
  so no padding): embeddings/s and input tok/s of each, and their ratio (a figure, no
  target);
- ``embed_match``: the smallest cosine between tokenwire's and HF's vector over the first
  ``MATCH_INPUTS`` inputs (target > 0.99 in bf16).

``--smoke``: a tiny Qwen3 stand-in on the CPU in float32, tiny counts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Protocol

SMOKE_EMBED_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3Model"], "model_type": "qwen3", "vocab_size": 1024,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
MATCH_INPUTS = 8  # inputs whose vectors are compared with HF's
MATCH_TARGET = 0.99  # smallest cosine, bf16
MAX_MODEL_LEN = 1024


class Record(Protocol):
    def __call__(self, **record: Any) -> None: ...


def embedding_config(args: argparse.Namespace) -> dict[str, Any]:
    """The model's config.json: the smoke stand-in, or a bundled config as a bare decoder."""
    from tokenwire.runtime.loader.bundled_configs import bundled_config_path

    if args.smoke:
        return dict(SMOKE_EMBED_CONFIG)
    path = bundled_config_path(args.model)
    if path is None:
        raise SystemExit(f"embed: {args.model!r} is not a bundled config")
    config: dict[str, Any] = json.loads(path.read_text())
    arch = str(config["architectures"][0]).removesuffix("ForCausalLM")
    return {**config, "architectures": [f"{arch}Model"]}


def write_model(config: dict[str, Any], folder: Path, device: str, dtype: Any) -> Any:
    """Random weights for ``config`` (seeded) saved to ``folder``; returns the HF model."""
    import torch
    from transformers import AutoConfig, AutoModel

    hf_config = AutoConfig.for_model(**config)
    build: Any = AutoModel.from_config  # untyped in transformers
    torch.manual_seed(0)
    with torch.device(device):
        model = build(hf_config, dtype=dtype)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": str(dtype)[6:]}))
    return model


def inputs(config: dict[str, Any], requests: int, tokens: int) -> list[list[int]]:
    """``requests`` distinct token-id inputs of ``tokens`` each (no special tokens)."""
    vocab = min(int(config["vocab_size"]), 32000) - 3
    return [
        [3 + (i * 7919 + j * 31 + j * j) % vocab for j in range(tokens)] for i in range(requests)
    ]


def hf_embed(model: Any, prompts: list[list[int]], batch: int, device: str) -> tuple[float, Any]:
    """Seconds and L2-normalized last-position vectors of ``model`` over ``prompts``."""
    import torch

    def run() -> Any:
        out = []
        with torch.inference_mode():
            for start in range(0, len(prompts), batch):
                ids = torch.tensor(prompts[start : start + batch], device=device)
                hidden = model(input_ids=ids).last_hidden_state[:, -1].float()
                out.append(torch.nn.functional.normalize(hidden, dim=-1))
        if device == "cuda":
            torch.cuda.synchronize()
        return torch.cat(out).cpu()

    hf_embed_once(model, prompts[:batch], device)
    start = time.perf_counter()
    vectors = run()
    return time.perf_counter() - start, vectors


def hf_embed_once(model: Any, prompts: list[list[int]], device: str) -> None:
    """One warm-up forward (kernel selection, allocator)."""
    import torch

    with torch.inference_mode():
        model(input_ids=torch.tensor(prompts, device=device))


def tokenwire_embed(
    folder: Path, prompts: list[list[int]], args: argparse.Namespace, batch: int
) -> tuple[float, Any]:
    """Seconds and vectors of ``LLM.embed`` over every prompt at once (after a warm-up)."""
    import torch

    from tokenwire.runtime.llm import LLM

    llm = LLM(
        str(folder), device="cpu" if args.smoke else "cuda",
        dtype="float32" if args.smoke else "bfloat16", max_model_len=MAX_MODEL_LEN,
        max_num_seqs=256, max_num_batched_tokens=16384,
        kv_cache_memory=(64 << 20) if args.smoke else (4 << 30),
    )  # fmt: skip
    try:
        llm.embed(prompts[:batch], use_tqdm=False)  # warm-up
        start = time.perf_counter()
        out = llm.embed(prompts, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    return seconds, torch.tensor([o.outputs.embedding for o in out])


def min_cosine(a: Any, b: Any) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min())


def stage_embed(args: argparse.Namespace, record: Record, work: Path) -> None:
    import torch

    label = args.label or args.model
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        torch.set_num_threads(1)
    config = embedding_config(args)
    requests, tokens, batch = (
        (8, 32, 4) if args.smoke else (args.embed_requests, args.embed_tokens, args.embed_batch)
    )
    prompts = inputs(config, requests, tokens)
    folder = work / "embed-model"
    model = write_model(config, folder, device, torch.float32 if args.smoke else torch.bfloat16)
    hf_s, hf_vectors = hf_embed(model, prompts, batch, device)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    tw_s, tw_vectors = tokenwire_embed(folder, prompts, args, batch)
    cosine = min_cosine(tw_vectors[:MATCH_INPUTS], hf_vectors[:MATCH_INPUTS])
    record(kind="embed_match", model=label, inputs=min(MATCH_INPUTS, requests),
           min_cosine=round(cosine, 5), ok=cosine > MATCH_TARGET)  # fmt: skip
    record(kind="embed_throughput", model=label, requests=requests, input_tokens=tokens,
           pooling="LAST", hf_batch=batch, dimensions=int(tw_vectors.shape[-1]),
           tokenwire_s=round(tw_s, 4), hf_s=round(hf_s, 4),
           tokenwire_emb_s=round(requests / tw_s, 1), hf_emb_s=round(requests / hf_s, 1),
           tokenwire_tok_s=round(requests * tokens / tw_s, 1),
           hf_tok_s=round(requests * tokens / hf_s, 1), ratio=round(hf_s / tw_s, 3))  # fmt: skip
