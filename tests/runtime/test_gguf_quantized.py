"""GGUF checkpoints kept quantized (``--quantization gguf``; the default on CPU, dtype auto).

- tiny synthetic llama GGUFs written with ``gguf.GGUFWriter`` (int4: Q4_0 attention + Q4_1
  MLP; int8: Q8_0 everywhere; llama.cpp's q/k row permutation applied): tokenwire loads them
  kept quantized and its float32 greedy tokens equal HF ``generate()`` on the weights
  de-quantized independently by ``gguf.quants.dequantize``; a file mixing Q4 and Q8 linears
  has no kept-quantized plan and loads de-quantized, still equal to HF; Q4_K_M's mixed q/k/v
  layer is kept part by part; TP=2 equals TP=1;
- the default model (SmolLM2-135M Q4_1): kept quantized by default (float32 model, int4
  linears on torch's bf16 int4 kernel); kept quantized with float32 matmuls (exact dense
  copy) equals HF on transformers' de-quantization for 32 tokens; the default bf16-matmul path
  agrees with that for the first ``BF16_AGREE`` tokens of every prompt.

The converted-directory cache is pre-seeded for the synthetic files (config.json, no
tokenizer: prompts are token ids; the de-quantized weights only for the mixed file), so
transformers never converts them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_synthetic import greedy, hf_reference, seed_cache, write_synthetic
from parity import NEW_TOKENS, distinct_prompts
from tiny_models import default_gguf_path

from tokenwire.kernels.quant_matmul import prepare_w4a16, w4a16_matmul
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.gguf_convert import ensure_converted

PROMPTS = distinct_prompts()[:4]
LLAMA = {"hidden_size": 128, "intermediate_size": 256}
# The default (bf16-matmul int4) path's greedy tokens must equal the float32 reference's for
# this many tokens. Measured: all 32 of 32 on four prompts (these two, "Once upon a time" and
# "Tell me a story about a lighthouse keeper.", ignore_eos); 16 leaves a margin for other CPUs'
# bf16 kernels.
BF16_AGREE = 16


def _int4(hf: str) -> QT:
    return QT.Q4_0 if ".self_attn." in hf else QT.Q4_1


def _mixed(hf: str) -> QT:
    return QT.Q4_0 if ".self_attn." in hf else QT.Q8_0


def _q4_k_m(hf: str) -> QT:
    """llama.cpp's Q4_K_M recipe in miniature: v and down projections Q6_K, the rest Q4_K."""
    return QT.Q6_K if (".v_proj." in hf or ".down_proj." in hf) else QT.Q4_K


# Per fused layer: the layer's prepared weights (int4 / int8 group) or None (float).
_LAYERS = {
    "int4": {"qkv_proj": "w4a16", "o_proj": "w4a16", "gate_up_proj": "w4a16", "down_proj": "w4a16"},
    "int8": {"qkv_proj": "w8a16", "o_proj": "w8a16", "gate_up_proj": "w8a16", "down_proj": "w8a16"},
    "mixed": {
        "qkv_proj": "w4a16",
        "o_proj": "w4a16",
        "gate_up_proj": "w8a16",
        "down_proj": "w8a16",
    },
    # q/k Q4_K beside a Q6_K v: kept part by part (float32 model: a dense copy of them)
    "q4_k_m": {
        "qkv_proj": "kquant",
        "o_proj": "w4a16",
        "gate_up_proj": "w4a16",
        "down_proj": "w8a16",
    },
}
K_QUANT_LLAMA = {"hidden_size": 256, "intermediate_size": 512}  # K-quants: 256 per block


def layer_kinds(llm: LLM) -> dict[str, str | None]:
    """Layer 0's fused linears: what each holds prepared (None: an unquantized weight)."""
    kinds: dict[str, str | None] = {}
    model = llm.engine.executor.worker.runner.model  # type: ignore[attr-defined]
    for name, module in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if ".layers.0." in f".{name}." and short in _LAYERS["int4"]:
            held = [k for k in ("w4a16", "w8a16", "kquant") if k in module.__dict__]
            kinds[short] = held[0] if held else None
    return kinds


@pytest.mark.parametrize(
    ("case", "types", "quantization"),
    [
        ("int4", _int4, "gguf"),
        ("int8", lambda _: QT.Q8_0, "gguf"),
        ("mixed", _mixed, "gguf"),
        ("q4_k_m", _q4_k_m, "gguf"),
    ],
)
def test_synthetic_gguf_greedy_equals_hf(
    case: str,
    types: Callable[[str], QT],
    quantization: str | None,
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENWIRE_CACHE_DIR", str(tmp_path / "cache"))
    src = tiny_model_factory("llama", **(K_QUANT_LLAMA if case == "q4_k_m" else LLAMA))
    path, reference = write_synthetic(src, tmp_path / f"{case}.gguf", types)
    seed_cache(path, src, None if quantization else reference)
    llm = LLM(
        str(path), device="cpu", dtype="float32", quantization="gguf", num_gpu_blocks_override=64
    )
    facts = llm.engine.facts
    assert facts.quantization == quantization
    assert layer_kinds(llm) == _LAYERS[case]
    if case == "q4_k_m":  # Q6_K down projection: int8 with one scale per 16 inputs
        model = llm.engine.executor.worker.runner.model  # type: ignore[attr-defined]
        assert model.model.layers[0].mlp.down_proj.prepared("w8a16").group_size == 16
    float_bytes = 4 * sum(t.numel() for t in reference.values())
    if quantization is not None:  # float32 runs a dense copy beside nothing else: same bytes
        assert facts.weight_bytes <= float_bytes
    want = hf_reference(src, reference, tmp_path / "hf", PROMPTS)
    assert greedy(llm, PROMPTS, NEW_TOKENS) == want


def test_quantization_gguf_needs_a_gguf_file(tiny_model_factory: Callable[..., Path]) -> None:
    src = tiny_model_factory("llama", **LLAMA)
    with pytest.raises(ValueError, match=r"--quantization gguf needs a \.gguf model file"):
        LLM(str(src), device="cpu", quantization="gguf")


DEFAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def default_reference() -> list[list[int]]:
    """HF transformers' greedy tokens on its own de-quantization of the default GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ensure_converted(default_gguf_path())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small ops: one thread is faster on a shared 2-core box
    with torch.inference_mode():
        for prompt in DEFAULT_PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(gen[0, ids.shape[1] :].tolist())
    torch.set_num_threads(threads)
    return out


@pytest.mark.slow
def test_default_model_float32_kept_quantized_equals_hf(default_reference: list[list[int]]) -> None:
    llm = LLM(dtype="float32", quantization="gguf", max_model_len=256, num_gpu_blocks_override=64)
    assert llm.engine.facts.quantization == "gguf"
    assert greedy(llm, DEFAULT_PROMPTS, NEW_TOKENS) == default_reference


@pytest.mark.slow
def test_default_model_runs_kept_quantized_by_default(default_reference: list[list[int]]) -> None:
    llm = LLM(max_model_len=256, num_gpu_blocks_override=64)
    facts = llm.engine.facts
    assert (facts.quantization, facts.dtype) == ("gguf", "float32")
    folder = ensure_converted(default_gguf_path())
    float_bytes = (folder / "model.safetensors").stat().st_size
    assert facts.weight_bytes < float_bytes
    tokens = greedy(llm, DEFAULT_PROMPTS, NEW_TOKENS)
    assert all(len(t) > 0 for t in tokens)
    for got, want in zip(tokens, default_reference, strict=True):
        assert got[:BF16_AGREE] == want[:BF16_AGREE]
    config = json.loads((folder / "config.json").read_text())
    assert config.get("quantization_config") is None


def test_int4pack_runs_every_row_count() -> None:
    """torch's int4 kernel for any number of rows (no bf16 copy for large calls: it rounded a
    row differently, defects #20); it agrees with the float32 reference within bf16 rounding."""
    from tokenwire.kernels.w4a16 import dequantize_w4a16, pack_int4

    gen = torch.Generator().manual_seed(0)
    k, n = 128, 48
    qweight = pack_int4(torch.randint(0, 16, (k, n), generator=gen))
    scales = torch.rand(k // 32, n, generator=gen) * 0.02
    zeros = torch.rand(k // 32, n, generator=gen) * 15
    w = prepare_w4a16(
        qweight, scales, zeros, None, 32, "cpu", torch.float32, compute_dtype=torch.bfloat16
    )
    assert w.backend == "int4pack"
    ref = dequantize_w4a16(qweight, scales, zeros, None, 32)
    for rows in (1, 4, 5, 64):
        x = torch.randn(rows, k, generator=gen)
        got = w4a16_matmul(x, w)
        want = x @ ref.t()
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * float(want.abs().max()))


def test_synthetic_int4_tp2_equals_tp1(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two gloo ranks: q/k/v and gate/up split along N, o/down along K and its groups."""
    monkeypatch.setenv("TOKENWIRE_CACHE_DIR", str(tmp_path / "cache"))
    src = tiny_model_factory("llama", **LLAMA)
    path, _ = write_synthetic(src, tmp_path / "int4.gguf", _int4)
    seed_cache(path, src, None)
    runs = []
    for tp in (1, 2):
        llm = LLM(
            str(path), device="cpu", dtype="float32", quantization="gguf",
            num_gpu_blocks_override=64, tensor_parallel_size=tp,
        )  # fmt: skip
        assert llm.engine.facts.quantization == "gguf"
        runs.append(greedy(llm, PROMPTS, NEW_TOKENS))
        llm.shutdown()
    assert runs[0] == runs[1]
