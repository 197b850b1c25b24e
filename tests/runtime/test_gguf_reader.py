"""The GGUF reader keeps Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K tensors quantized in the canonical
layouts (issue 32, item 4: K-quants).

References are independent of the reader: transformers' de-quantized float32 weights of the
default model (the cached conversion), and ``gguf.quants.dequantize`` on synthetic files
written with ``gguf.GGUFWriter``. The canonical records are de-quantized here with the
contract's formula, ``W = (code - zero) * scale``, written out again in numpy.

Tolerance: F32/F16/BF16, Q8_0 and Q4_0 are bit-exact. Q4_1 stores zero = -m/d (a rounded
float32 division), so ``(q - zero) * d`` may differ from GGUF's ``q * d + m``: measured on the
default model, at most 1 ulp of the largest |w| in the block (4.8e-7 absolute); that bound
is what the tests assert. Q4_K stores zero = dmin * m / (d * sc) the same way: the same
1-ulp bound holds per 32-element sub-block. Q6_K (int8 codes q - 32, scale d * sc per 16) is
bit-exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_layout import Array, llama_cpp_permute, unpermute
from tiny_models import default_gguf_path

from tokenwire.runtime.loader.gguf import GGUFInt4, GGUFInt8, GGUFWeight, iter_gguf_weights
from tokenwire.runtime.loader.gguf.names import hf_name
from tokenwire.runtime.loader.gguf_convert import ensure_converted

# ---- independent references ---------------------------------------------------------------


def dequant_int4(rec: GGUFInt4) -> Array:
    """W [N, K] from the canonical int4 layout, by the contract's formula."""
    q = rec.qweight.numpy().astype(np.int64)  # [K // 8, N]
    codes = np.stack([(q >> (4 * j)) & 0xF for j in range(8)], axis=1)  # k = 8r + j
    k = q.shape[0] * 8
    group = np.arange(k) // rec.group_size
    codes_f = codes.reshape(k, -1).astype(np.float32)
    return ((codes_f - rec.zeros.numpy()[group]) * rec.scales.numpy()[group]).T


def dequant_int8(rec: GGUFInt8) -> Array:
    """W [N, K] from the canonical int8 layout."""
    group = np.arange(rec.qweight.shape[1]) // rec.group_size
    return rec.qweight.numpy().astype(np.float32) * rec.scales.numpy()[:, group]


def as_float(weight: GGUFWeight) -> Array:
    if isinstance(weight, GGUFInt4):
        return dequant_int4(weight)
    if isinstance(weight, GGUFInt8):
        return dequant_int8(weight)
    return weight.float().numpy()


def block_ulps(got: Array, want: Array, block: int = 32) -> float:
    """Max |got - want| in units of the ulp of the largest |want| in its 32-element block."""
    err = np.abs(got - want).reshape(want.shape[0], -1, block).max(axis=-1)
    scale = np.abs(want).reshape(want.shape[0], -1, block).max(axis=-1)
    return float((err / np.spacing(scale.astype(np.float32))).max())


# ---- the default model against transformers' conversion -----------------------------------


@pytest.fixture(scope="module")
def default_weights() -> dict[str, GGUFWeight]:
    return dict(iter_gguf_weights(default_gguf_path()))


@pytest.fixture(scope="module")
def transformers_weights() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(ensure_converted(default_gguf_path()) / "model.safetensors")


def test_default_model_kinds_and_names(
    default_weights: dict[str, GGUFWeight], transformers_weights: dict[str, torch.Tensor]
) -> None:
    assert set(default_weights) == set(transformers_weights)
    kinds = [type(w).__name__ for w in default_weights.values()]
    assert (kinds.count("GGUFInt4"), kinds.count("GGUFInt8"), kinds.count("Tensor")) == (
        210,
        1,
        61,
    )
    embed = default_weights["model.embed_tokens.weight"]
    assert isinstance(embed, GGUFInt8)  # the model's only Q8_0 tensor
    assert embed.qweight.shape == (49152, 576) and embed.scales.shape == (49152, 18)
    q = default_weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, GGUFInt4)
    assert q.qweight.dtype == torch.int32 and q.qweight.shape == (576 // 8, 576)
    assert q.scales.dtype == q.zeros.dtype == torch.float32 and q.scales.shape == (18, 576)
    for name, w in default_weights.items():
        if isinstance(w, GGUFInt4 | GGUFInt8):
            assert (w.out_features, w.in_features) == tuple(transformers_weights[name].shape)


def test_default_model_equals_transformers_dequantization(
    default_weights: dict[str, GGUFWeight], transformers_weights: dict[str, torch.Tensor]
) -> None:
    worst_int4 = 0.0
    for name, weight in default_weights.items():
        got, want = as_float(weight), transformers_weights[name].numpy()
        assert got.shape == want.shape, name
        if isinstance(weight, GGUFInt4):  # Q4_1 (zero = -m/d): within 1 ulp of block max
            ulps = block_ulps(got, want)
            assert ulps <= 1.0, (name, ulps)
            worst_int4 = max(worst_int4, float(np.abs(got - want).max()))
            # The record's own de-quantization is the same formula, bit for bit.
            assert np.array_equal(weight.dequantize().numpy(), got), name
        else:  # Q8_0 and F32: bit-exact (q / d products are exact in float32)
            assert np.array_equal(got, want), name
    assert worst_int4 < 1e-6


# ---- synthetic files ------------------------------------------------------------------------

HEADS, KV_HEADS, HIDDEN = 4, 2, 96


def _q6_k_bytes(rows: int, cols: int, rng: np.random.Generator) -> Array:
    """Random Q6_K blocks with a sane fp16 scale d (the last 2 bytes of each 210-byte block)."""
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
    blocks[..., 208:] = np.full((rows, cols // 256, 1), 0.01, "<f2").view(np.uint8)
    return blocks.reshape(rows, -1)


def _q4_k_bytes(rows: int, cols: int, rng: np.random.Generator) -> Array:
    """Random Q4_K super-blocks with sane fp16 d and dmin (bytes 0-1 and 2-3 of each 144);
    every 6-bit scale and min and every nibble random. Row 0's first sub-block gets scale 0
    (its d zeroed), the d * sc == 0 case: a constant -dmin * m."""
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = rng.uniform(-0.02, 0.02, (rows, cols // 256, 1)).astype("<f2").view(np.uint8)
    blocks[..., 2:4] = rng.uniform(0, 0.02, (rows, cols // 256, 1)).astype("<f2").view(np.uint8)
    blocks[0, 0, 0:2] = 0  # d = +0.0: every sub-block of this super-block is constant
    return blocks.reshape(rows, -1)


def _q4_1_with_flat_blocks(rng: np.random.Generator) -> Array:
    """[37, 160] Q4_1 weights where block (0, 0) is constant 0.75 (d = 0, m = 0.75) and
    block (1, 2) is all zero: the d == 0 cases of the zero = -m/d formula."""
    w = rng.standard_normal((37, 160)).astype(np.float32)
    w[0, :32] = 0.75
    w[1, 64:96] = 0.0
    return w


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[Array, QT]]) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc", "é"])  # arrays are skipped
    writer.add_array("tokenizer.ggml.scores", [0.5, 1.5, 2.5, 3.5])
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    for name, (data, qtype) in tensors.items():
        if qtype in (QT.F32, QT.F16, QT.I32):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Array]]:
    """A 2-layer llama GGUF covering every type; returns it and each tensor's HF-order float
    reference (gguf.quants.dequantize of the stored bytes, q/k rows un-permuted)."""
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    hf_q = rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)
    hf_k = rng.standard_normal((KV_HEADS * head_dim, HIDDEN)).astype(np.float32)
    q_stored = llama_cpp_permute(hf_q, HEADS)
    k_stored = llama_cpp_permute(hf_k, KV_HEADS)
    plain: dict[str, tuple[Array, QT]] = {
        "token_embd.weight": (rng.standard_normal((50, HIDDEN)).astype(np.float16), QT.F16),
        "output_norm.weight": (rng.standard_normal(HIDDEN).astype(np.float32), QT.F32),
        "rope_freqs.weight": (np.ones(head_dim // 2, np.float32), QT.F32),  # ignored
        "blk.0.attn_q.weight": (q_stored, QT.Q4_0),
        "blk.0.attn_k.weight": (k_stored, QT.Q4_1),
        "blk.0.attn_v.weight": (rng.standard_normal((48, HIDDEN)).astype(np.float32), QT.Q8_0),
        "blk.0.attn_norm.weight": (rng.standard_normal(HIDDEN).astype(np.float32), QT.BF16),
        "blk.0.ffn_down.weight": (_q4_1_with_flat_blocks(rng), QT.Q4_1),
        "blk.0.ffn_gate.weight": (rng.standard_normal((3, 32)).astype(np.float32), QT.Q8_0),
        "blk.0.ffn_up.weight": (rng.standard_normal((5, 32)).astype(np.float32), QT.Q4_0),
        "blk.1.attn_q.weight": (q_stored, QT.F32),
        "blk.1.attn_k.weight": (k_stored, QT.F32),
        "blk.1.ffn_up.weight": (rng.standard_normal(64).astype(np.float32), QT.Q8_0),  # 1-D
    }
    stored = {
        n: (a if t in (QT.F32, QT.F16) else gguf.quants.quantize(a, t), t)
        for n, (a, t) in plain.items()
    }
    stored["blk.1.ffn_down.weight"] = (_q6_k_bytes(7, 256, rng), QT.Q6_K)
    stored["blk.1.ffn_gate.weight"] = (_q4_k_bytes(9, 512, rng), QT.Q4_K)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, "llama", stored)
    expected: dict[str, Array] = {}
    for name, (data, qtype) in stored.items():
        if name == "rope_freqs.weight":
            continue
        ref = gguf.quants.dequantize(data, qtype).astype(np.float32)
        if ".attn_q." in name:
            ref = unpermute(ref, HEADS)
        elif ".attn_k." in name:
            ref = unpermute(ref, KV_HEADS)
        expected[hf_name(name)] = ref
    # The un-permuted F32 q/k are HF's original rows: the inverse really inverts llama.cpp.
    assert np.array_equal(expected["model.layers.1.self_attn.q_proj.weight"], hf_q)
    assert np.array_equal(expected["model.layers.1.self_attn.k_proj.weight"], hf_k)
    return path, expected


def test_synthetic_every_type(synthetic: tuple[Path, dict[str, Array]]) -> None:
    path, expected = synthetic
    got = dict(iter_gguf_weights(path))
    assert set(got) == set(expected)  # rope_freqs is skipped, nothing else is
    layer0 = "model.layers.0."
    kinds = {
        f"{layer0}self_attn.q_proj.weight": GGUFInt4,  # Q4_0, permuted
        f"{layer0}self_attn.k_proj.weight": GGUFInt4,  # Q4_1, permuted
        f"{layer0}self_attn.v_proj.weight": GGUFInt8,
        f"{layer0}mlp.down_proj.weight": GGUFInt4,  # Q4_1 [37, 160], flat blocks
        f"{layer0}mlp.gate_proj.weight": GGUFInt8,  # [3, 32]
        f"{layer0}mlp.up_proj.weight": GGUFInt4,  # Q4_0 [5, 32]
        "model.layers.1.mlp.down_proj.weight": GGUFInt8,  # Q6_K, group 16
        "model.layers.1.mlp.gate_proj.weight": GGUFInt4,  # Q4_K, group 32
    }
    for name, weight in got.items():
        assert isinstance(weight, kinds.get(name, torch.Tensor)), name
        value = as_float(weight)
        assert value.shape == expected[name].shape, name
        if isinstance(weight, GGUFInt4) and not torch.all(weight.zeros == 8):  # Q4_1, Q4_K
            assert block_ulps(value, expected[name]) <= 1.0, name
            assert weight.group_size == 32, name
        else:
            assert np.array_equal(value, expected[name]), name
    dtypes = {n: w.dtype for n, w in got.items() if isinstance(w, torch.Tensor)}
    assert dtypes["model.embed_tokens.weight"] == torch.float16
    assert dtypes[f"{layer0}input_layernorm.weight"] == torch.bfloat16
    down = got["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(down, GGUFInt8) and down.group_size == 16  # Q6_K kept: 16 per scale
    gate = got["model.layers.1.mlp.gate_proj.weight"]
    assert isinstance(gate, GGUFInt4)
    assert np.all(
        as_float(gate)[0, :256] == expected["model.layers.1.mlp.gate_proj.weight"][0, :256]
    )
    assert dtypes["model.layers.1.mlp.up_proj.weight"] == torch.float32  # 1-D Q8_0


def test_q4_1_flat_blocks_are_exact(synthetic: tuple[Path, dict[str, Array]]) -> None:
    path, _ = synthetic
    down = dict(iter_gguf_weights(path))["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, GGUFInt4)
    w = dequant_int4(down)
    assert np.all(w[0, :32] == np.float32(0.75)) and np.all(w[1, 64:96] == 0.0)


def test_qwen2_rows_are_not_permuted(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)
    bias = rng.standard_normal(HIDDEN).astype(np.float32)
    tensors = {
        "blk.0.attn_q.weight": (gguf.quants.quantize(q, QT.Q8_0), QT.Q8_0),
        "blk.0.attn_q.bias": (bias, QT.F32),
        "blk.0.attn_k_norm.weight": (bias[:24].copy(), QT.F32),
    }
    write_gguf(tmp_path / "q.gguf", "qwen2", tensors)
    got = dict(iter_gguf_weights(tmp_path / "q.gguf"))
    weight = got["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(weight, GGUFInt8)
    want = gguf.quants.dequantize(tensors["blk.0.attn_q.weight"][0], QT.Q8_0)
    assert np.array_equal(dequant_int8(weight), want)
    assert torch.equal(got["model.layers.0.self_attn.q_proj.bias"], torch.from_numpy(bias))
    assert "model.layers.0.self_attn.k_norm.weight" in got


def test_names_agree_with_gguf_tensor_map() -> None:
    """Our GGUF -> HF names invert gguf-py's own HF -> GGUF table for each architecture."""
    parts = [
        "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
        "ffn_up", "ffn_down",
    ]  # fmt: skip
    cases = {
        gguf.MODEL_ARCH.LLAMA: parts,
        gguf.MODEL_ARCH.QWEN2: parts,
        gguf.MODEL_ARCH.QWEN3: [*parts, "attn_q_norm", "attn_k_norm"],
    }
    for arch, block_parts in cases.items():
        table = gguf.get_tensor_name_map(arch, 3)
        names = ["token_embd", "output_norm", "output", *(f"blk.2.{p}" for p in block_parts)]
        for name in names:
            hf = hf_name(f"{name}.weight")
            assert table.get_name(hf.removesuffix(".weight")) == name, (arch, name, hf)


# ---- errors ---------------------------------------------------------------------------------


def _read_all(path: Path) -> Iterator[str]:
    for name, _ in iter_gguf_weights(path):
        yield name


def test_unsupported_type_names_tensor_and_type(tmp_path: Path) -> None:
    raw = np.zeros((4, 292), np.uint8)  # one Q8_K block per row; gguf cannot de-quantize it
    write_gguf(tmp_path / "k.gguf", "llama", {"blk.0.ffn_up.weight": (raw, QT.Q8_K)})
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' \(Q8_K\).*not supported"):
        list(_read_all(tmp_path / "k.gguf"))
    ints = {"blk.0.ffn_up.weight": (np.arange(8, dtype=np.int32), QT.I32)}
    write_gguf(tmp_path / "i.gguf", "llama", ints)
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' \(I32\)"):
        list(_read_all(tmp_path / "i.gguf"))


def test_damaged_block_scale_names_tensor(tmp_path: Path) -> None:
    w = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, QT.Q4_1)
    raw[3, 20:22] = np.array([np.inf], "<f2").view(np.uint8)  # d of row 3, block 1
    write_gguf(tmp_path / "bad.gguf", "llama", {"blk.1.attn_v.weight": (raw, QT.Q4_1)})
    with pytest.raises(ValueError, match=r"'blk\.1\.attn_v\.weight' \(Q4_1\).*non-finite.*row 3"):
        list(_read_all(tmp_path / "bad.gguf"))


def test_truncated_file_and_unknown_name(tmp_path: Path) -> None:
    w = np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32)
    write_gguf(tmp_path / "t.gguf", "llama", {"blk.0.attn_v.weight": (w, QT.F32)})
    data = (tmp_path / "t.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_v\.weight'.*truncated"):
        list(_read_all(tmp_path / "t.gguf"))
    write_gguf(tmp_path / "u.gguf", "llama", {"blk.0.mystery.weight": (w, QT.F32)})
    with pytest.raises(ValueError, match=r"'blk\.0\.mystery\.weight' has no known HF"):
        list(_read_all(tmp_path / "u.gguf"))
    write_gguf(tmp_path / "a.gguf", "gpt2", {"blk.0.attn_v.weight": (w, QT.F32)})
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported"):
        list(_read_all(tmp_path / "a.gguf"))


def test_records_validate_shapes() -> None:
    qweight = torch.zeros(4, 6, dtype=torch.int32)  # K = 32, N = 6
    good = torch.zeros(1, 6)
    assert GGUFInt4(qweight, good, good, 32).in_features == 32
    with pytest.raises(ValueError, match="zeros shape"):
        GGUFInt4(qweight, good, torch.zeros(6, 1), 32)
    with pytest.raises(ValueError, match="multiple of group"):
        GGUFInt4(qweight, good, good, 64)
    with pytest.raises(ValueError, match="qweight has dtype"):
        GGUFInt8(torch.zeros(6, 32, dtype=torch.int32), torch.zeros(6, 1), 32)
