"""Quantized checkpoints at load: every quantized linear (fused q/k/v and gate/up included)
computes ``x @ W.T`` of the independently de-quantized reference weights, at TP=1 and on
each rank of TP=2 (packed tensors, per-group scales and ``g_idx`` cut by the layer layouts;
act order keeps every group on a row-parallel rank); impossible splits of packed tensors
are refused naming ``--tensor-parallel-size``; bad checkpoints (missing / misshapen /
mistyped tensors, unsupported settings) fail with a ValueError naming the tensor or the
config key, and ``tokenwire serve`` reports it as a one-line error, never a traceback;
``--quantization`` contradicting the checkpoint names the flag; the reported scheme and
weight bytes; dummy quantized weights for benchmarks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from quant_checkpoints import GPTQSpec, write_awq, write_gptq
from safetensors.torch import load_file, save_file

from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.engine.core_loop import engine_info
from tokenwire.runtime.engine_args import EngineArgs
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model
from tokenwire.runtime.models.arch import ModelArch
from tokenwire.runtime.models.layers.quant.awq import AWQConfig
from tokenwire.runtime.models.layers.quant.gptq import GPTQConfig
from tokenwire.runtime.models.llama import build_model
from tokenwire.runtime.sampling_params import SamplingParams

CPU = torch.device("cpu")
TP_FLAG = "--tensor-parallel-size"
LLAMA = {"hidden_size": 128, "intermediate_size": 256}

WRITERS: dict[str, Callable[[Path, Path], dict[str, torch.Tensor]]] = {
    "gptq-asym-g32": lambda s, o: write_gptq(s, o, GPTQSpec(group_size=32, sym=False)),
    "gptq-sym-g64-act-order": lambda s, o: write_gptq(s, o, GPTQSpec(group_size=64, desc_act=True)),
    "gptq-8bit-g32": lambda s, o: write_gptq(s, o, GPTQSpec(bits=8, group_size=32)),
    "awq-g32": lambda s, o: write_awq(s, o, 32),
}


def load(path: Path, tp: TPGroup | None = None, **kwargs: Any) -> LoadedModel:
    config = ModelConfig(model=str(path), **kwargs)
    return load_model(config, CPU, torch.float32, tp=tp or TPGroup.single())


@pytest.fixture(scope="module")
def llama(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", **LLAMA)


@pytest.fixture(scope="module")
def checkpoints(
    llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, dict[str, torch.Tensor]]]:
    cache: dict[str, tuple[Path, dict[str, torch.Tensor]]] = {}

    def get(name: str) -> tuple[Path, dict[str, torch.Tensor]]:
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            cache[name] = (out, WRITERS[name](llama, out))
        return cache[name]

    return get


# ----------------------------------------------------------------------------- layers
def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (0, 2), (1, 2)])
@pytest.mark.parametrize("case", list(WRITERS))
def test_each_linear_equals_the_dequantized_reference_slice(
    case: str, rank: int, world: int, checkpoints: Callable[..., Any]
) -> None:
    path, state = checkpoints(case)
    loaded = load(path, TPGroup(rank, world))  # loading needs no collectives
    assert loaded.quantization == case.split("-")[0]
    gen = torch.Generator().manual_seed(rank)
    d = loaded.arch.head_dim
    for i, layer in enumerate(loaded.model.model.layers):
        w = {n: state[f"model.layers.{i}.{n}.weight"] for n in _PROJ}
        qkv = layer.self_attn.qkv_proj
        q_rows = slice(qkv.heads.head_start * d, qkv.heads.head_start * d + qkv.q_size)
        kv_rows = slice(qkv.heads.kv_head_start * d, qkv.heads.kv_head_start * d + qkv.kv_size)
        want = torch.cat(
            [w["self_attn.q_proj"][q_rows], *(w[f"self_attn.{p}_proj"][kv_rows] for p in "kv")]
        )
        x = torch.randn(5, qkv.hidden_size, generator=gen)
        _close(qkv(x), x @ want.T)
        gate_up = layer.mlp.gate_up_proj
        start, length = gate_up.shares["gate"]
        rows = slice(start, start + length)
        want = torch.cat([w["mlp.gate_proj"][rows], w["mlp.up_proj"][rows]])
        _close(gate_up(x), x @ want.T)
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            row = layer.get_submodule(name)
            cols = slice(row.input_start, row.input_start + row.input_size)
            x = torch.randn(3, row.input_size, generator=gen)
            partial = row.linear_method.apply(row, x, None)  # before the all-reduce
            _close(partial, x @ w[name][:, cols].T)


_PROJ = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _arch(llama: Path, **changes: Any) -> ModelArch:
    config = json.loads((llama / "config.json").read_text())
    return ModelArch.from_hf_config({**config, **changes})


def test_impossible_splits_of_packed_tensors_name_the_flag(llama: Path) -> None:
    arch = _arch(llama)
    # o_proj's 128 inputs over 4 ranks: 32 per rank, half a group of 64.
    with pytest.raises(ValueError, match=TP_FLAG) as err:
        build_model(arch, CPU, torch.float32, 64, TPGroup(0, 4), GPTQConfig(group_size=64))
    assert "scales" in str(err.value)
    # Act order: a rank's rows may use any group, so each keeps all of them (as vLLM).
    model = build_model(
        arch, CPU, torch.float32, 64, TPGroup(1, 4), GPTQConfig(group_size=64, desc_act=True)
    )
    o_proj = model.model.layers[0].self_attn.o_proj
    assert o_proj.param("scales").shape == (2, 128)  # every group of the 128 inputs
    assert o_proj.param("g_idx").shape == (32,)  # this rank's rows
    assert o_proj.param("qweight").shape == (4, 128)
    # gate/up with 200 outputs: each rank's 100 gate columns cut a packed AWQ word.
    odd = _arch(llama, intermediate_size=200)
    with pytest.raises(ValueError, match=TP_FLAG):
        build_model(odd, CPU, torch.float32, 64, TPGroup(0, 2), AWQConfig(group_size=32))
    build_model(odd, CPU, torch.float32, 64, TPGroup.single(), AWQConfig(group_size=8))


# ----------------------------------------------------------------------------- bad files
def _variant(
    src: Path,
    out: Path,
    drop: tuple[str, ...] = (),
    replace: dict[str, torch.Tensor] | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """A copy of checkpoint ``src`` with tensors dropped / replaced and config changes."""
    out.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    for name in drop:
        del tensors[name]
    tensors.update(replace or {})
    save_file(tensors, str(out / "model.safetensors"))
    data = json.loads((src / "config.json").read_text())
    data["quantization_config"].update(config or {})
    (out / "config.json").write_text(json.dumps(data))
    return out


def test_bad_gptq_checkpoints_name_the_tensor(
    checkpoints: Callable[..., Any], tmp_path: Path
) -> None:
    src, _ = checkpoints("gptq-sym-g64-act-order")
    tensors = load_file(str(src / "model.safetensors"))
    pre = "model.layers.0."
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"drop": ("model.layers.1.mlp.down_proj.scales",)},
            r"missing.*layers\.1\.mlp\.down_proj\.scales",
        ),
        (
            {"drop": (f"{pre}self_attn.k_proj.qzeros",)},
            r"missing.*layers\.0\.self_attn\.k_proj\.qzeros",
        ),
        (
            {"drop": (f"{pre}self_attn.o_proj.g_idx",)},
            r"missing.*layers\.0\.self_attn\.o_proj\.g_idx",
        ),
        (
            {"replace": {f"{pre}mlp.up_proj.scales": torch.ones(3, 256, dtype=torch.float16)}},
            r"shape mismatch for model\.layers\.0\.mlp\.up_proj\.scales",
        ),
        (
            {
                "replace": {
                    f"{pre}self_attn.o_proj.qweight": tensors[
                        f"{pre}self_attn.o_proj.qweight"
                    ].half()
                }
            },
            r"dtype mismatch for model\.layers\.0\.self_attn\.o_proj\.qweight",
        ),
        (
            {
                "replace": {
                    f"{pre}self_attn.v_proj.g_idx": torch.arange(128, dtype=torch.int32) // 64
                }
            },
            r"model\.layers\.0\.self_attn\.v_proj\.g_idx differs",
        ),
        (
            {"replace": {f"{pre}mlp.down_proj.bias": torch.ones(128, dtype=torch.float16)}},
            r"unexpected weight 'model\.layers\.0\.mlp\.down_proj\.bias'",
        ),
        ({"config": {"bits": 3}}, r"quantization_config\.bits=3 is not supported"),
        ({"config": {"checkpoint_format": "marlin"}}, r"quantization_config\.checkpoint_format"),
        ({"config": {"bits": 8, "sym": False}}, r"quantization_config\.sym"),
        ({"config": {"quant_method": "bitsandbytes"}}, r"quantization_config\.quant_method"),
    ]
    for i, (change, match) in enumerate(cases):
        bad = _variant(src, tmp_path / f"bad{i}", **change)
        with pytest.raises(ValueError, match=match):
            load(bad)


def test_bad_awq_checkpoints_name_the_tensor_or_key(
    checkpoints: Callable[..., Any], tmp_path: Path
) -> None:
    src, _ = checkpoints("awq-g32")
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.self_attn\.o_proj\.qzeros"):
        load(_variant(src, tmp_path / "a", drop=("model.layers.1.self_attn.o_proj.qzeros",)))
    with pytest.raises(ValueError, match=r"quantization_config\.version"):
        load(_variant(src, tmp_path / "b", config={"version": "gemv"}))
    with pytest.raises(ValueError, match=r"quantization_config\.zero_point"):
        load(_variant(src, tmp_path / "c", config={"zero_point": False}))
    # a GPTQ-packed tensor under an AWQ config: qweight [K/8, N] instead of [K, N/8]
    gptq = load_file(str(checkpoints("gptq-asym-g32")[0] / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.qweight"
    with pytest.raises(ValueError, match=f"shape mismatch for {name}"):
        load(_variant(src, tmp_path / "d", replace={name: gptq[name]}))


def test_serve_reports_a_bad_checkpoint_in_one_line(
    checkpoints: Callable[..., Any], tmp_path: Path
) -> None:
    """The server startup path: exit code 2 and the tensor's name, no traceback."""
    src, _ = checkpoints("gptq-asym-g32")
    bad = _variant(src, tmp_path / "bad", drop=("model.layers.1.mlp.down_proj.scales",))
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
    assert exe is not None
    done = subprocess.run(
        [exe, "serve", str(bad), "--device", "cpu", "--grpc-port", "0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "tokenwire: error: checkpoint is missing weights for: " in done.stderr
    assert "model.layers.1.mlp.down_proj.scales" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


# ----------------------------------------------------------------------------- the flag
def test_quantization_flag_contradicting_the_checkpoint_names_the_flag(
    checkpoints: Callable[..., Any], llama: Path
) -> None:
    gptq, _ = checkpoints("gptq-asym-g32")
    with pytest.raises(ValueError, match=r"--quantization awq contradicts the checkpoint"):
        LLM(
            str(gptq),
            device="cpu",
            quantization="awq",
            num_gpu_blocks_override=16,
            max_model_len=128,
        )
    with pytest.raises(ValueError, match=r"--quantization int8 contradicts"):
        load(gptq, quantization="int8")
    with pytest.raises(ValueError, match=r"--quantization gptq needs a GPTQ checkpoint"):
        load(llama, quantization="gptq")
    with pytest.raises(ValueError, match=r"--quantization"):
        EngineArgs(quantization="bitsandbytes").create_engine_config()  # type: ignore[arg-type]
    assert load(gptq, quantization="gptq").quantization == "gptq"  # agreeing is fine
    assert load(llama).quantization is None


# ----------------------------------------------------------------------------- reporting
def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_reported_scheme_and_weight_bytes(checkpoints: Callable[..., Any], llama: Path) -> None:
    """bfloat16 on CPU runs torch's packed int4 kernel: the linears hold their int4 codes
    and per-group scales/zeros, under a third of their bfloat16 bytes. (A float32 model on
    CPU keeps a de-quantized float32 copy, the exact fast path, and reports those bytes.)"""
    path, _ = checkpoints("gptq-asym-g32")
    plain = load_file(str(llama / "model.safetensors"))
    linear = {k: v for k, v in plain.items() if any(p in k for p in _PROJ)}
    other = sum(v.numel() * 2 for k, v in plain.items() if k not in linear)  # bf16
    codes = sum(v.numel() // 2 for v in linear.values())  # 4 bits per weight
    with LLM(
        str(path), device="cpu", dtype="bfloat16", num_gpu_blocks_override=16, max_model_len=128
    ) as llm:
        info = engine_info(llm.engine)
        assert (info.quantization, llm.engine.facts.quantization) == ("gptq", "gptq")
        assert other + codes <= info.weight_bytes < other + codes * 4 // 3  # bf16: 4x codes
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    with LLM(
        str(llama), device="cpu", num_gpu_blocks_override=16, max_model_len=128
    ) as unquantized:
        info = engine_info(unquantized.engine)
        assert info.quantization is None
        assert info.weight_bytes == _bytes(plain.values())  # float32, as in the file
    with LLM(
        str(llama),
        device="cpu",
        dtype="bfloat16",
        quantization="int8",
        num_gpu_blocks_override=16,
        max_model_len=128,
    ) as int8:
        info = engine_info(int8.engine)
        assert info.quantization == "int8"
        # int8 codes and one bfloat16 scale per output row (torch's packed int8 kernel)
        assert info.weight_bytes == other + codes * 2 + sum(2 * v.shape[0] for v in linear.values())


@pytest.mark.parametrize("scheme", ["gptq", "awq", "int8"])
def test_dummy_quantized_weights(scheme: str, llama: Path, tmp_path: Path) -> None:
    """``--load-format dummy --quantization gptq|awq|int8`` (benchmarks without a
    checkpoint): 4-bit group-128 defaults; TP=2 ranks split a 256-wide model's groups."""
    config = json.loads((llama / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, head_dim=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with LLM(
        str(tmp_path),
        device="cpu",
        load_format="dummy",
        quantization=scheme,
        num_gpu_blocks_override=16,
        max_model_len=128,
    ) as llm:
        assert llm.engine.facts.quantization == scheme
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    # Each rank draws the TP=1 tensors and keeps its slices: its q/k/v columns equal TP=1's.
    one = load(tmp_path, load_format="dummy", quantization=scheme)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    full = one.model.model.layers[0].self_attn.qkv_proj(x)  # [q 4x64 | k 2x64 | v 2x64]
    for rank in (0, 1):
        loaded = load(tmp_path, TPGroup(rank, 2), load_format="dummy", quantization=scheme)
        assert loaded.quantization == scheme
        cols = [*range(128 * rank, 128 * rank + 128), *range(256 + 64 * rank, 320 + 64 * rank)]
        cols += range(384 + 64 * rank, 448 + 64 * rank)
        got = loaded.model.model.layers[0].self_attn.qkv_proj(x)
        torch.testing.assert_close(got, full[:, cols], rtol=1e-5, atol=1e-5)
