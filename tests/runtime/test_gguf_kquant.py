"""GGUF K-quants kept quantized on the CPU fast path (``gguf_kquant``, ``kernels.vnni_parts``).

- De-quantization against ``gguf.quants.dequantize`` on random blocks: Q5_K, Q6_K and Q8_0
  bit-exact, both the canonical record and the VNNI int8 layout the kernel multiplies by;
  Q4_K's canonical record within 2 float32 ulps of the block's largest weight (its zero is
  ``dmin * m / (d * sc)``), its VNNI int4 layout within fp16 rounding of the scale and
  minimum (2^-11 relative, as every kept Q4 layer).
- A synthetic Q4_K_M-style GGUF (Q4_K q/k/o/gate/up, Q6_K v and down, Q5_K up on layer 1):
  with dtype auto on CPU it loads kept quantized (q/k/v part by part: int4 q/k beside an
  int8 v), runs the fused decoder stack, and its greedy tokens equal HF ``generate()`` on the
  float32 de-quantized weights, each prompt alone and all of them in one batch; so do the
  torch layers over the same kept weights (``--no-cpu-fused-layers``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf_layout import random_k_quant
from gguf_synthetic import greedy, hf_reference, seed_cache, write_synthetic
from parity import NEW_TOKENS, distinct_prompts

from tokenwire.kernels.vnni_matmul import dequantize_vnni, pack_int8k_vnni, vnni_status
from tokenwire.kernels.vnni_parts import VnniParts, prepare_vnni_parts, vnni_parts_matmul
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.gguf.blocks import decode_q8_0
from tokenwire.runtime.loader.gguf.blocks_k import decode_q4_k, decode_q5_k, decode_q6_k
from tokenwire.runtime.loader.gguf.records import GGUFInt4, GGUFInt8
from tokenwire.runtime.models.fused_stack import FusedModel
from tokenwire.runtime.models.layers.quant.gguf_kquant import kquant_tensors

needs_vnni = pytest.mark.skipif(
    not vnni_status().loaded, reason=f"no VNNI kernel here: {vnni_status().reason}"
)
SHAPE = (48, 512)


def _blocks(qtype: QT) -> np.ndarray:
    rng = np.random.default_rng(7)
    if qtype == QT.Q8_0:
        return gguf.quants.quantize(rng.standard_normal(SHAPE).astype(np.float32) * 0.05, qtype)
    return random_k_quant(SHAPE, qtype, rng)


@pytest.mark.parametrize(
    ("qtype", "decode", "group"),
    [(QT.Q5_K, decode_q5_k, 32), (QT.Q6_K, decode_q6_k, 16), (QT.Q8_0, decode_q8_0, 32)],
)
def test_int8_types_dequantize_bit_exact(qtype: QT, decode: Callable, group: int) -> None:
    raw = _blocks(qtype)
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    a = decode(raw)
    mins = None if a.mins is None else torch.from_numpy(a.mins)
    record = GGUFInt8(torch.from_numpy(a.qweight), torch.from_numpy(a.scales), group, mins)
    assert torch.equal(record.dequantize(), want)
    if vnni_status().loaded:
        codes, scales, mins32 = kquant_tensors(record)
        packed = pack_int8k_vnni(codes, scales, mins32 if mins is not None else None)
        assert torch.equal(dequantize_vnni(packed), want)


def test_q4_k_dequantizes_within_its_stated_bound() -> None:
    raw = _blocks(QT.Q4_K)
    want = torch.from_numpy(gguf.quants.dequantize(raw, QT.Q4_K).astype(np.float32))
    a = decode_q4_k(raw)
    record = GGUFInt4(*(torch.from_numpy(x) for x in (a.qweight, a.scales, a.zeros)), 32)
    ulp = torch.finfo(torch.float32).eps * want.abs().view(-1, 32).amax(-1, keepdim=True)
    assert ((record.dequantize() - want).view(-1, 32).abs() <= 2 * ulp).all()
    codes, scales, mins = kquant_tensors(record)
    dense = (codes.float().view(-1, 32) * scales[:, ::2].reshape(-1, 1)).view(SHAPE)
    dense = dense + mins.repeat_interleave(32, 1)
    assert ((dense - want).view(-1, 32).abs() <= 2 * ulp).all()
    if vnni_status().loaded:
        from tokenwire.kernels.vnni_matmul import pack_int4_vnni

        packed = dequantize_vnni(pack_int4_vnni(codes.to(torch.uint8), scales[:, ::2], mins))
        assert ((packed - want).abs() <= 2.0**-11 * 16 * want.abs().max()).all()


def _canonical(qtype: QT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random blocks of ``qtype`` as the canonical (codes, scales, mins) and the reference
    weight (``gguf.quants.dequantize``)."""
    raw = _blocks(qtype)
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    if qtype == QT.Q4_K:
        a4 = decode_q4_k(raw)
        record: GGUFInt4 | GGUFInt8 = GGUFInt4(
            *(torch.from_numpy(x) for x in (a4.qweight, a4.scales, a4.zeros)), 32
        )
    else:
        a = decode_q6_k(raw) if qtype == QT.Q6_K else decode_q5_k(raw)
        mins = None if a.mins is None else torch.from_numpy(a.mins)
        group = 16 if qtype == QT.Q6_K else 32
        record = GGUFInt8(torch.from_numpy(a.qweight), torch.from_numpy(a.scales), group, mins)
    return (*kquant_tensors(record), want)


def test_triton_kernel_runs_the_canonical_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (here: the Triton interpreter) a K-quant layer keeps the canonical layout and
    the int8 Triton kernel de-quantizes ``code * scale + min`` per tile: a Q4_K_M-style
    fused q/k/v (Q4_K rows beside Q6_K rows) and a Q5_K layer equal a float32 linear over the
    reference weights (``gguf.quants.dequantize``) within float32 accumulation error."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q4, q6, q5 = (_canonical(t) for t in (QT.Q4_K, QT.Q6_K, QT.Q5_K))
    fused = tuple(torch.cat([a, b]) for a, b in zip(q4, q6, strict=True))
    torch.manual_seed(0)
    x = torch.randn(3, SHAPE[1])
    bias = torch.randn(2 * SHAPE[0])
    for (codes, scales, mins, want), parts, b in (
        (fused, ((SHAPE[0], "int4"), (SHAPE[0], "int8")), bias),
        (q5, ((SHAPE[0], "int8"),), None),
    ):
        prepared = prepare_vnni_parts(
            codes,
            scales,
            mins,
            parts,
            vnni=False,
            dtype=torch.float32,
            triton=True,  # type: ignore[arg-type]
        )
        assert prepared.canonical is not None and prepared.dense is None
        out = vnni_parts_matmul(x, prepared, b)
        ref = F.linear(x.double(), want.double(), None if b is None else b.double())
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def _q4_k_m(hf: str) -> QT:
    """llama.cpp's Q4_K_M recipe in miniature (v and down Q6_K, the rest Q4_K), and one Q5_K
    up projection (Q5_K_M's)."""
    if ".v_proj." in hf or ".down_proj." in hf:
        return QT.Q6_K
    return QT.Q5_K if ".layers.1.mlp.up_proj." in hf else QT.Q4_K


@needs_vnni
def test_q4_k_m_runs_fused_kept_quantized_and_equals_hf(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENWIRE_CACHE_DIR", str(tmp_path / "cache"))
    src = tiny_model_factory("llama", hidden_size=256, intermediate_size=512)
    path, reference = write_synthetic(src, tmp_path / "q4_k_m.gguf", _q4_k_m)
    seed_cache(path, src, None)
    llm = LLM(str(path), device="cpu", num_gpu_blocks_override=64)
    assert (llm.engine.facts.quantization, llm.engine.facts.dtype) == ("gguf", "float32")
    model = llm.engine.executor.worker.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.__dict__.get("_fused"), FusedModel)
    layers = model.model.layers
    qkv = layers[0].self_attn.qkv_proj.prepared("kquant")
    assert isinstance(qkv, VnniParts) and qkv.dense is None
    assert [(p.mode, p.out_features) for p in qkv.parts] == [(4, 256 + 128), (16, 128)]
    assert layers[0].mlp.down_proj.prepared("w8a16").backend == "vnni"
    assert layers[0].mlp.gate_up_proj.prepared("w4a16").backend == "vnni"
    gate_up = layers[1].mlp.gate_up_proj.prepared("kquant")  # Q4_K gate beside a Q5_K up
    assert [(p.mode, p.out_features) for p in gate_up.parts] == [(4, 512), (16, 512)]
    prompts = distinct_prompts()[:4]
    want = hf_reference(src, reference, tmp_path / "hf", prompts)
    alone = [greedy(llm, [p], NEW_TOKENS)[0] for p in prompts]
    assert alone == want
    assert greedy(llm, prompts, NEW_TOKENS) == want
    llm.shutdown()
    # The torch layers over the same kept weights (vnni_matmul per linear, parts side by side).
    torch_layers = LLM(str(path), device="cpu", num_gpu_blocks_override=64, cpu_fused_layers=False)
    model = torch_layers.engine.executor.worker.runner.model  # type: ignore[attr-defined]
    assert model.__dict__.get("_fused") is None
    assert greedy(torch_layers, prompts, NEW_TOKENS) == want
