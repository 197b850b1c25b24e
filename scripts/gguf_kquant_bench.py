"""Q4_K_M against Q4_1, kept quantized on the CPU fast path: one-stream decode tok/s.

The default model (SmolLM2-135M) cannot hold K-quants: its hidden size, 576, is no multiple of
a K-quant super-block (256 inputs), so llama.cpp's own Q4_K_M of it falls back to Q5_0 / Q8_0
for every linear but ``ffn_down``. So both files here share the default model's layer count,
head size, GQA ratio, MLP width and vocabulary, with the hidden size raised to 768 (the next
multiple of 256; 12 heads of 64, 4 KV heads), random float weights (N(0, 0.02)), F16 tied
embeddings (the same float LM head in both), and the linears quantized two ways from the same
floats: Q4_1 everywhere (gguf-py's quantizer; the default model's type) and llama.cpp's Q4_K_M
recipe (Q4_K, with ``attn_v`` and ``ffn_down`` Q6_K on its ``use_more_bits`` layers; the
K-quant blocks written here, gguf-py cannot quantize them).

Each run is its own process (``--dtype auto`` on CPU: kept quantized, the fused decoder stack),
1 thread, a warm-up request, then greedy decode of ``--tokens`` tokens from a 16-token prompt,
runs interleaved A/B, A/B, ...; prints one JSON line per run, the medians and the load average.

    .venv/bin/python scripts/gguf_kquant_bench.py [--rounds 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

LAYERS, HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 30, 768, 1536, 12, 4, 49152
Array = npt.NDArray[Any]


def _fp16(x: Array) -> Array:
    return x.astype(np.float16).astype(np.float32)


def quantize_q4_k(w: Array) -> Array:
    """[N, K] float32 -> Q4_K rows (144 bytes per 256 inputs): per 32, scale and min from the
    block's range, 6-bit sub-scales and sub-mins under fp16 ``d`` / ``dmin``."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 8, 32)
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / 15.0
    d = _fp16(scale.max(-1) / 63.0)
    dmin = _fp16((-lo).max(-1) / 63.0)
    sc = np.clip(np.rint(scale / np.where(d == 0, 1, d)[..., None]), 0, 63).astype(np.uint8)
    mi = np.clip(np.rint(-lo / np.where(dmin == 0, 1, dmin)[..., None]), 0, 63).astype(np.uint8)
    eff, off = d[..., None] * sc, dmin[..., None] * mi
    q = np.rint((x + off[..., None]) / np.where(eff == 0, 1, eff)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8)
    out = np.zeros((n, k // 256, 144), np.uint8)
    out[..., 0:2] = d.astype("<f2")[..., None].view(np.uint8)
    out[..., 2:4] = dmin.astype("<f2")[..., None].view(np.uint8)
    out[..., 4:8] = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    out[..., 8:12] = (mi[..., :4] & 0x3F) | ((mi[..., 4:] >> 4) << 6)
    out[..., 12:16] = (sc[..., 4:] & 0x0F) | ((mi[..., 4:] & 0x0F) << 4)
    out[..., 16:] = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(n, k // 256, 128)
    return out.reshape(n, -1)


def quantize_q6_k(w: Array) -> Array:
    """[N, K] float32 -> Q6_K rows (210 bytes per 256 inputs): per 16, an int8 sub-scale
    under fp16 ``d``, codes -32..31."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 16, 16)
    scale = np.abs(x).max(-1) / 31.0
    d = _fp16(scale.max(-1) / 127.0)
    sc = np.clip(np.rint(scale / np.where(d == 0, 1, d)[..., None]), -128, 127).astype(np.int8)
    eff = d[..., None] * sc
    q = np.clip(np.rint(x / np.where(eff == 0, 1, eff)[..., None]), -32, 31).astype(np.int16)
    q8 = (q + 32).astype(np.uint8).reshape(n, k // 256, 2, 4, 32)  # [half, p, l]
    low, high = q8 & 0x0F, q8 >> 4
    ql = np.concatenate([low[..., 0, :] | (low[..., 2, :] << 4),
                         low[..., 1, :] | (low[..., 3, :] << 4)], axis=-1)  # fmt: skip
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    out = np.zeros((n, k // 256, 210), np.uint8)
    out[..., 0:128] = ql.reshape(n, k // 256, 128)
    out[..., 128:192] = qh.reshape(n, k // 256, 64)
    out[..., 192:208] = sc.view(np.uint8)
    out[..., 208:210] = d.astype("<f2")[..., None].view(np.uint8)
    return out.reshape(n, -1)


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: Q4_K_M's layers with Q6_K attn_v / ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def write_pair(folder: Path) -> dict[str, Path]:
    """The two GGUFs (same float weights) and config.json beside each in the cache."""
    import gguf
    from gguf import GGMLQuantizationType as QT

    rng = np.random.default_rng(0)
    head = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head, HIDDEN),
              "attn_v": (KV_HEADS * head, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
              "ffn_down": (HIDDEN, INTER)}  # fmt: skip
    floats = {f"blk.{i}.{p}.weight": (rng.standard_normal(s) * 0.02).astype(np.float32)
              for i in range(LAYERS) for p, s in shapes.items()}  # fmt: skip
    embed = (rng.standard_normal((VOCAB, HIDDEN)) * 0.02).astype(np.float16)
    paths = {}
    for kind in ("q4_1", "q4_k_m"):
        path = folder / f"{kind}.gguf"
        writer = gguf.GGUFWriter(path, "llama")
        writer.add_block_count(LAYERS)
        writer.add_head_count(HEADS)
        writer.add_head_count_kv(KV_HEADS)
        writer.add_tensor("token_embd.weight", embed)
        for i in range(LAYERS):
            for name in ("attn_norm", "ffn_norm"):
                writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(HIDDEN, np.float32))
            for part in shapes:
                w = floats[f"blk.{i}.{part}.weight"]
                if kind == "q4_1":
                    qtype, raw = QT.Q4_1, gguf.quants.quantize(w, QT.Q4_1)
                elif part in ("attn_v", "ffn_down") and _more_bits(i, LAYERS):
                    qtype, raw = QT.Q6_K, quantize_q6_k(w)
                else:
                    qtype, raw = QT.Q4_K, quantize_q4_k(w)
                back = gguf.quants.dequantize(raw, qtype)
                assert np.abs(back - w).max() < 0.25 * np.abs(w).max(), (kind, part)
                writer.add_tensor(f"blk.{i}.{part}.weight", raw, raw_dtype=qtype)
        writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths[kind] = path
    return paths


def _config() -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HIDDEN // HEADS,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 2048,
        "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip


def _child(path: str, tokens: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from tokenwire.runtime.llm import LLM
    from tokenwire.runtime.sampling_params import SamplingParams

    llm = LLM(path, device="cpu", max_model_len=512, num_gpu_blocks_override=64)
    model = llm.engine.executor.worker.runner.model  # type: ignore[attr-defined]
    fused = model.__dict__.get("_fused") is not None
    prompt = [[100 + 37 * j for j in range(16)]]
    llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    out = llm.generate(prompt, params, use_tqdm=False)
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    n = len(out[0].outputs[0].token_ids)
    facts = llm.engine.facts
    return {"tok_s": n / seconds, "cpu_ms_per_tok": 1000 * cpu_s / n, "fused": fused,
            "quantization": facts.quantization,
            "weight_mb": facts.weight_bytes / 2**20}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.tokens)))
        return
    from tokenwire.runtime.loader.gguf_convert import converted_dir

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TOKENWIRE_CACHE_DIR"] = str(Path(tmp) / "cache")
        paths = write_pair(Path(tmp))
        for path in paths.values():
            target = converted_dir(path)
            target.mkdir(parents=True)
            (target / "config.json").write_text(json.dumps(_config()))
        results: dict[str, list[float]] = {kind: [] for kind in paths}
        cpu: dict[str, list[float]] = {kind: [] for kind in paths}
        for r in range(args.rounds):
            for kind, path in paths.items():
                cmd = [sys.executable, __file__, "--child", str(path), "--tokens", str(args.tokens)]
                line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                run = json.loads(line.strip().splitlines()[-1])
                run.update(kind=kind, round=r, load=os.getloadavg()[0])
                print(json.dumps(run), flush=True)
                results[kind].append(run["tok_s"])
                cpu[kind].append(run["cpu_ms_per_tok"])
    medians = {kind: statistics.median(v) for kind, v in results.items()}
    cpu_medians = {kind: statistics.median(v) for kind, v in cpu.items()}
    ratio = medians["q4_k_m"] / medians["q4_1"]
    print(json.dumps({"median_tok_s": medians, "median_cpu_ms_per_tok": cpu_medians,
                      "q4_k_m_over_q4_1": ratio, "loadavg": os.getloadavg()}))  # fmt: skip


if __name__ == "__main__":
    main()
