"""FP8 (e4m3) weights end to end on CPU (float32).

Checkpoints are written here from a tiny random Llama the way the tools save them (float8
``weight`` tensors and ``weight_scale`` in safetensors): llm-compressor's compressed-tensors
``float-quantized`` (``strategy: tensor`` -> ``weight_scale [1]``, ``channel`` -> ``[N, 1]``,
scales in the float16 model dtype) and AutoFP8 / HF ``quant_method: fp8`` (``weight_scale []``
float32). HF transformers runs the same model with the weights de-quantized by this file's own
reference (``codes.float() * scale``); tokenwire's CPU path is weight-only (de-quantized
weights, float32 matmuls), so greedy tokens must be equal and the teacher-forced logprobs
agree to ``LOGPROB_TOL`` (1e-3 nats: float32 rounding of different matmul / attention kernels
over 2 layers is ~1e-5; the margin keeps the check robust without hiding a wrong scale, which
moves logprobs by >0.1). Fused q/k/v and gate/up with per-tensor scales keep one scale per
shard (the test gives every projection a different scale, so a shared or swapped one fails).
The CUDA path's arithmetic (per-token dynamic e4m3 activations x e4m3 weights, float32
accumulation) is checked through its torch emulation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from quant_checkpoints import (
    E4M3_MAX,
    GPTQSpec,
    e4m3,
    fp8_online_reference,
    is_linear,
    write_fp8,
    write_gptq,
    write_hf_reference,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tokenwire.kernels.fp8_matmul import fp8_matmul, prepare_fp8, scaled_mm_emulated
from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.engine.core_loop import engine_info
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.model_loader import LoadedModel, load_model
from tokenwire.runtime.sampling_params import SamplingParams

CPU = torch.device("cpu")
LLAMA = {"hidden_size": 128, "intermediate_size": 256}
PROMPTS = [[5, 17, 99, 230, 7, 41, 300, 12], [9, 3, 200, 61, 14, 90, 33, 2, 18, 250, 71]]
NEW_TOKENS = 12
LOGPROB_TOL = 1e-3


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def llama(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", **LLAMA)


@pytest.fixture(scope="module")
def checkpoints(
    llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, dict[str, torch.Tensor]]]:
    cache: dict[str, tuple[Path, dict[str, torch.Tensor]]] = {}

    def get(fmt: str) -> tuple[Path, dict[str, torch.Tensor]]:
        if fmt not in cache:
            out = tmp_path_factory.mktemp(fmt)
            cache[fmt] = (out, write_fp8(llama, out, fmt))
        return cache[fmt]

    return get


def load(path: Path, tp: TPGroup | None = None, **kwargs: Any) -> LoadedModel:
    config = ModelConfig(model=str(path), **kwargs)
    return load_model(config, CPU, torch.float32, tp=tp or TPGroup.single())


def engine_greedy(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=2, ignore_eos=True)
    result = []
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        seq = out.outputs[0]
        assert seq.logprobs is not None
        result.append(
            (seq.token_ids, [{t: lp.logprob for t, lp in p.items()} for p in seq.logprobs])
        )
    return result


def assert_equals_hf(hf_dir: Path, got: list[tuple[list[int], list[dict[int, float]]]]) -> None:
    """Greedy tokens are HF's argmax at every step; logprobs within ``LOGPROB_TOL``."""
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for prompt, (tokens, logprobs) in zip(PROMPTS, got, strict=True):
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + tokens])).logits[0]
        ref = torch.log_softmax(logits.float(), dim=-1)
        for pos, (token, top) in enumerate(zip(tokens, logprobs, strict=True)):
            row = ref[len(prompt) - 1 + pos]
            assert int(row.argmax()) == token, pos
            for tid, lp in top.items():
                assert abs(lp - row[tid].item()) < LOGPROB_TOL, (pos, tid, lp, row[tid].item())


def run(path: Path, **kwargs: Any) -> tuple[list[tuple[list[int], list[dict[int, float]]]], LLM]:
    llm = LLM(str(path), device="cpu", dtype="float32", num_gpu_blocks_override=64, **kwargs)
    return engine_greedy(llm), llm


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("fmt", ["ct-tensor", "ct-channel", "hf-tensor"])
def test_fp8_checkpoint_equals_hf_on_dequantized_weights(
    fmt: str, llama: Path, checkpoints: Callable[..., Any], tmp_path: Path
) -> None:
    path, state = checkpoints(fmt)
    got, llm = run(path)
    assert_equals_hf(write_hf_reference(llama, state, tmp_path / "hf"), got)
    assert llm.engine.facts.quantization == "fp8"
    assert engine_info(llm.engine).quantization == "fp8"


def test_online_fp8_equals_hf_with_the_same_rounding(llama: Path, tmp_path: Path) -> None:
    got, llm = run(llama, quantization="fp8")
    assert_equals_hf(write_hf_reference(llama, fp8_online_reference(llama), tmp_path / "hf"), got)
    assert engine_info(llm.engine).quantization == "fp8"
    # and the rounding is real: the unquantized model gives other logprobs
    plain, _ = run(llama)
    assert (
        max(
            abs(a - b[t])
            for (_, x), (_, y) in zip(plain, got, strict=True)
            for p, b in zip(x, y, strict=True)
            for t, a in p.items()
            if t in b
        )
        > LOGPROB_TOL
    )


# ----------------------------------------------------------------------------- TP
_PROJ = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}


@pytest.mark.parametrize("fmt", ["ct-tensor", "ct-channel"])
def test_tp2_rank_slices_equal_the_dequantized_reference(
    fmt: str, checkpoints: Callable[..., Any]
) -> None:
    """Each rank of TP=2 computes its slice of the TP=1 product: per-tensor scales (one per
    fused shard) whole on every rank, per-channel scales cut along N with the weight."""
    path, state = checkpoints(fmt)
    gen = torch.Generator().manual_seed(0)
    for rank in (0, 1):
        loaded = load(path, TPGroup(rank, 2))
        assert loaded.quantization == "fp8"
        d = loaded.arch.head_dim
        for i, layer in enumerate(loaded.model.model.layers):
            w = {p: state[f"model.layers.{i}.{p}.weight"] for p in _PROJ["qkv"]}
            w.update(
                {p: state[f"model.layers.{i}.mlp.{p}.weight"] for p in ("gate_proj", "up_proj")}
            )
            qkv = layer.self_attn.qkv_proj
            q = slice(qkv.heads.head_start * d, qkv.heads.head_start * d + qkv.q_size)
            kv = slice(qkv.heads.kv_head_start * d, qkv.heads.kv_head_start * d + qkv.kv_size)
            q_w, k_w, v_w = (w[p] for p in _PROJ["qkv"])
            want = torch.cat([q_w[q], k_w[kv], v_w[kv]])
            x = torch.randn(4, qkv.hidden_size, generator=gen)
            torch.testing.assert_close(qkv(x), x @ want.T, rtol=1e-5, atol=1e-5)
            gate_up = layer.mlp.gate_up_proj
            start, length = gate_up.shares["gate"]
            rows = slice(start, start + length)
            want = torch.cat([w["gate_proj"][rows], w["up_proj"][rows]])
            torch.testing.assert_close(gate_up(x), x @ want.T, rtol=1e-5, atol=1e-5)
            down = layer.mlp.down_proj
            cols = slice(down.input_start, down.input_start + down.input_size)
            x = torch.randn(3, down.input_size, generator=gen)
            full = state[f"model.layers.{i}.mlp.down_proj.weight"]
            partial = down.linear_method.apply(down, x, None)  # before the all-reduce
            torch.testing.assert_close(partial, x @ full[:, cols].T, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tp2_engine_equals_tp1(checkpoints: Callable[..., Any]) -> None:
    path, _ = checkpoints("ct-tensor")
    one, _ = run(path)
    with LLM(
        str(path), device="cpu", dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=64
    ) as two:
        got = engine_greedy(two)
        assert [t for t, _ in got] == [t for t, _ in one]
        for (_, a), (_, b) in zip(got, one, strict=True):
            for pa, pb in zip(a, b, strict=True):
                for tid, lp in pa.items():
                    assert abs(lp - pb[tid]) < LOGPROB_TOL
        assert two.engine.facts.quantization == "fp8"


# ----------------------------------------------------------------------------- CUDA math
def test_scaled_mm_emulation_equals_a_per_token_reference() -> None:
    """The ``scaled_mm`` backend's arithmetic (emulated in torch) against this test's own
    per-token e4m3 quantization of x and a float32 matmul: equal to float32 rounding (1e-5
    relative). Both are within e4m3's rounding (2^-4 relative per operand) of the exact
    product, and that bound is tight enough to fail on a wrong scale."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=gen) * torch.logspace(-2, 2, 7)[:, None]
    w = torch.randn(48, 64, generator=gen) * 0.05
    bias = torch.randn(48, generator=gen)
    w_scale = w.abs().amax(dim=1) / E4M3_MAX
    w_codes = e4m3(w, w_scale[:, None])
    x_scale = x.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    x_codes = e4m3(x, x_scale)
    want = (x_codes.float() * x_scale) @ (w_codes.float() * w_scale[:, None]).T + bias
    got = scaled_mm_emulated(x, w_codes, w_scale, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = x @ w.T  # bias-free, so the relative error is the matmul's
    bound = x.abs() @ w.abs().T  # e4m3 rounds each operand by <= 2^-4 relative
    got_mm = scaled_mm_emulated(x, w_codes, w_scale, None)
    assert float(((got_mm - exact).abs() / bound).max()) < 2 * 2**-4
    rel = float(torch.linalg.norm(got_mm - exact) / torch.linalg.norm(exact))
    wrong = scaled_mm_emulated(x, w_codes, w_scale * 1.25, None)  # a wrong scale
    assert rel < 0.06 < float(torch.linalg.norm(wrong - exact) / torch.linalg.norm(exact))
    # bfloat16 activations: same result, rounded to bfloat16; leading batch dims kept
    got16 = scaled_mm_emulated(x.bfloat16().reshape(7, 1, 64), w_codes, w_scale, bias)
    assert got16.shape == (7, 1, 48) and got16.dtype == torch.bfloat16
    want16 = scaled_mm_emulated(x.bfloat16().float(), w_codes, w_scale, bias)
    torch.testing.assert_close(got16.float().reshape(7, 48), want16, rtol=1e-2, atol=1e-2)
    # CPU prepares a de-quantized copy: same numbers as the reference
    dense = prepare_fp8(w_codes, w_scale, torch.float32)
    assert dense.backend == "dense"
    torch.testing.assert_close(dense.weight, w_codes.float() * w_scale[:, None])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_backend_equals_its_emulation(dtype: torch.dtype) -> None:
    """On CUDA the prepared backend (``_scaled_mm`` on sm_89+, de-quantized weights before)
    matches the torch emulation of its arithmetic to the output dtype's rounding (2e-2; the
    fp8 tensor cores accumulate in float32 like the emulation)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(33, 256, generator=gen).to("cuda", dtype)
    w = (torch.randn(96, 256, generator=gen) * 0.05).cuda()
    scale = w.abs().amax(dim=1) / E4M3_MAX
    codes = e4m3(w, scale[:, None])
    bias = torch.randn(96, generator=gen).to("cuda", dtype)
    prepared = prepare_fp8(codes, scale, dtype)
    sm89 = torch.cuda.get_device_capability() >= (8, 9)
    assert prepared.backend == ("scaled_mm" if sm89 else "dequant")
    got = fp8_matmul(x, prepared, bias)
    assert got.dtype == dtype and got.shape == (33, 96)
    want = (
        scaled_mm_emulated(x, codes, scale, bias)
        if sm89
        else x @ (codes.float() * scale[:, None]).to(dtype).T + bias
    )
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- bad files
def _variant(src: Path, out: Path, replace: dict[str, Any] | None = None, **config: Any) -> Path:
    out.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    for name, value in (replace or {}).items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(out / "model.safetensors"))
    data = json.loads((src / "config.json").read_text())
    data["quantization_config"].update(config)
    (out / "config.json").write_text(json.dumps(data))
    return out


def test_bad_fp8_checkpoints_name_the_tensor_or_key(
    checkpoints: Callable[..., Any], tmp_path: Path
) -> None:
    ct, _ = checkpoints("ct-channel")
    hf, _ = checkpoints("hf-tensor")
    tensors = load_file(str(ct / "model.safetensors"))
    pre = "model.layers.1."
    cases: list[tuple[Path, Path, dict[str, Any], str]] = [
        (
            ct,
            tmp_path / "a",
            {"replace": {f"{pre}mlp.up_proj.weight_scale": None}},
            r"missing.*layers\.1\.mlp\.up_proj\.weight_scale",
        ),
        (
            hf,
            tmp_path / "b",
            {"replace": {f"{pre}self_attn.o_proj.weight_scale": None}},
            r"missing.*layers\.1\.self_attn\.o_proj\.weight_scale",
        ),
        (
            ct,
            tmp_path / "c",
            {"replace": {f"{pre}self_attn.k_proj.weight_scale": torch.ones(64)}},
            r"shape mismatch for model\.layers\.1\.self_attn\.k_proj\.weight_scale",
        ),
        (
            hf,
            tmp_path / "d",
            {"replace": {f"{pre}self_attn.v_proj.weight_scale": torch.ones(2)}},
            r"shape mismatch for model\.layers\.1\.self_attn\.v_proj\.weight_scale",
        ),
        (
            ct,
            tmp_path / "e",
            {
                "replace": {
                    f"{pre}mlp.down_proj.weight": tensors[f"{pre}mlp.down_proj.weight"].half()
                }
            },
            r"dtype mismatch for model\.layers\.1\.mlp\.down_proj\.weight: checkpoint float16",
        ),
        (
            hf,
            tmp_path / "f",
            {"weight_block_size": [128, 128]},
            r"quantization_config\.weight_block_size",
        ),
        (
            hf,
            tmp_path / "g",
            {"activation_scheme": "static"},
            r"quantization_config\.activation_scheme='static' is not supported",
        ),
        (ct, tmp_path / "h", {"format": "int-quantized"}, r"quantization_config\.format"),
        (ct, tmp_path / "i", {"ignore": ["lm_head", "re:.*mlp.*"]}, r"quantization_config\.ignore"),
    ]
    for src, out, change, match in cases:
        bad = _variant(src, out, change.pop("replace", None), **change)
        with pytest.raises(ValueError, match=match):
            load(bad)


def test_quantization_flag_against_the_checkpoint(
    checkpoints: Callable[..., Any], llama: Path, tmp_path: Path
) -> None:
    gptq = tmp_path / "gptq"
    write_gptq(llama, gptq, GPTQSpec(group_size=32))
    with pytest.raises(ValueError, match=r"--quantization fp8 contradicts the checkpoint"):
        load(gptq, quantization="fp8")
    ct, _ = checkpoints("ct-tensor")
    with pytest.raises(
        ValueError, match=r"--quantization int8 contradicts the checkpoint, which is fp8"
    ):
        load(ct, quantization="int8")
    assert load(ct, quantization="fp8").quantization == "fp8"  # agreeing is fine
    assert load(checkpoints("hf-tensor")[0], quantization="fp8").quantization == "fp8"


def test_weight_bytes_of_the_cpu_path(checkpoints: Callable[..., Any], llama: Path) -> None:
    """CPU keeps a de-quantized copy of each fp8 linear (torch has no fp8 CPU matmul; per-call
    de-quantization measured 2-100x slower): the reported bytes are those float32 weights
    plus the float32 scales, and the rest of the checkpoint as loaded."""
    path, _ = checkpoints("ct-channel")
    plain = load_file(str(llama / "model.safetensors"))
    total = sum(v.numel() * 4 for v in plain.values())
    scales = sum(v.shape[0] * 4 for k, v in plain.items() if is_linear(k))
    with LLM(str(path), device="cpu", num_gpu_blocks_override=16, max_model_len=128) as llm:
        info = engine_info(llm.engine)
        assert info.quantization == "fp8"
        assert info.weight_bytes == total + scales
