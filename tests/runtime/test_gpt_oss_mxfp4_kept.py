"""gpt-oss MXFP4 experts kept quantized where the Triton kernels run (``gpt_oss_mxfp4``).

A tiny random gpt-oss whose experts are quantized to MXFP4 (``tests/support/mxfp4_checkpoint``)
loaded with ``TRITON_INTERPRET=1`` (the Triton path on CPU) holds the checkpoint's uint8
blocks and scales, no de-quantized expert weights, in fewer bytes; they de-quantize to the
exact weights the CPU path loads; each MoE layer's output equals the de-quantized layer's;
and the engine's greedy tokens equal the de-quantized CPU run (the whole forward under the
interpreter). Without the interpreter nothing changes. Tensor parallelism: a rank holds its
gate/up rows and whole 32-blocks of down; a share that is not whole blocks de-quantizes.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from mxfp4_checkpoint import write_mxfp4_pair
from parity import distinct_prompts, hf_greedy
from safetensors.torch import load_file, save_file
from test_gpt_oss_mxfp4 import GPT_OSS
from tiny_models import build_tiny_model
from tp_ranks import GlooRanks, assert_ranks_identical, assert_same_run, run_rank

from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.model_loader import load_model
from tokenwire.runtime.models.gpt_oss_mxfp4 import MXFP4Experts, keeps_mxfp4
from tokenwire.runtime.models.moe import FusedMoE, SparseMoeBlock
from tokenwire.runtime.models.mxfp4 import dequantize_mxfp4
from tokenwire.runtime.sampling_params import SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(MXFP4 checkpoint, the same model with its experts de-quantized)."""
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4-kept")
    return write_mxfp4_pair(build_tiny_model("llama", root / "src", **GPT_OSS), root)


def _experts(model: torch.nn.Module) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def _moe_blocks(model: torch.nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def _expert_bytes(model: torch.nn.Module) -> int:
    return sum(
        p.numel() * p.element_size() for m in _experts(model) for p in m.parameters(recurse=True)
    )


def test_interpreter_load_keeps_the_checkpoint_tensors(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """uint8 blocks/scales equal to the checkpoint's, no w13/w2 weights, fewer bytes; they
    de-quantize (de-interleaved) to exactly what the CPU path loads."""
    mxfp4, _ = pair
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    plain = load_model(ModelConfig(model=str(mxfp4)), CPU, torch.float32).model
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kept = load_model(ModelConfig(model=str(mxfp4)), CPU, torch.float32).model
    assert all(m.mxfp4 is None and m.w13_weight is not None for m in _experts(plain))
    (weights_file,) = mxfp4.glob("*.safetensors")
    stored = load_file(str(weights_file))
    for layer, (held, want) in enumerate(zip(_experts(kept), _experts(plain), strict=True)):
        assert held.w13_weight is None and held.w2_weight is None and held.mxfp4 is not None
        assert all(p.dtype == torch.uint8 for p in held.mxfp4.parameters())
        for name, param in held.mxfp4.named_parameters():
            assert torch.equal(param, stored[f"model.layers.{layer}.mlp.experts.{name}"])
        (b13, s13), (b2, s2) = held.mxfp4.pairs()
        w13 = dequantize_mxfp4(b13, s13)
        assert want.w13_weight is not None and want.w2_weight is not None
        assert torch.equal(torch.cat((w13[:, ::2], w13[:, 1::2]), dim=1), want.w13_weight)
        assert torch.equal(dequantize_mxfp4(b2, s2), want.w2_weight)
        assert held.w13_bias is not None and torch.equal(held.w13_bias, want.w13_bias)
    # 64 x 64 experts: 4.25 bits per weight against 32, the biases unchanged.
    assert _expert_bytes(kept) < _expert_bytes(plain) / 3


def test_moe_layers_equal_the_dequantized_layers(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    mxfp4, _ = pair
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    plain = load_model(ModelConfig(model=str(mxfp4)), CPU, torch.float32).model
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kept = load_model(ModelConfig(model=str(mxfp4)), CPU, torch.float32).model
    blocks = list(zip(_moe_blocks(kept), _moe_blocks(plain), strict=True))
    assert len(blocks) == GPT_OSS["num_hidden_layers"]
    x = torch.randn(13, GPT_OSS["hidden_size"], generator=torch.Generator().manual_seed(0))
    for held, want in blocks:
        with torch.inference_mode():
            got, ref = held(x), want(x)
        assert held.experts.mxfp4 is not None
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_greedy_tokens_equal_the_dequantized_cpu_run(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole engine under the interpreter (attention too) on the kept-quantized experts
    gives the de-quantized CPU run's greedy tokens, which are HF ``generate()``'s on the
    de-quantized model."""
    mxfp4, reference = pair
    prompts = distinct_prompts()[:2]
    hf = hf_greedy(reference, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=len(hf[0]))

    def run() -> tuple[list[list[int]], LLM]:
        llm = LLM(str(mxfp4), device="cpu", max_num_seqs=4)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs], llm

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    expected, _ = run()
    assert expected == hf
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got, llm = run()
    assert got == expected
    assert len({tuple(t) for t in expected}) > 1
    model = llm.engine.executor.worker.runner.model  # type: ignore[attr-defined]
    assert any(isinstance(m, MXFP4Experts) for m in model.modules())


def _kept_rank(tp: TPGroup, model_dir: str) -> dict[str, Any]:
    """``run_rank`` plus the shapes of the MXFP4 tensors this rank holds."""
    model = load_model(ModelConfig(model=model_dir), CPU, torch.float32, tp=tp).model
    held = {n: tuple(p.shape) for n, p in model.named_parameters() if ".mxfp4." in n}
    return {**run_rank(tp, model_dir), "held": held}


def test_tp2_gloo_ranks_keep_their_blocks_and_match_tp1(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """I = 64 over 2 ranks: each keeps 32 gate/up rows (64 interleaved) and one 32-block of
    down, runs the MXFP4 kernel under the interpreter and equals the de-quantized TP=1 run."""
    mxfp4, reference = pair
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ref = run_rank(TPGroup.single(), str(reference))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks inherit it
    pool = GlooRanks(2)
    try:
        results = pool.run(_kept_rank, str(mxfp4))
    finally:
        pool.close()
    for result in results:
        held = result.pop("held")
        assert held["model.layers.0.mlp.experts.mxfp4.gate_up_proj_blocks"] == (4, 64, 2, 16)
        assert held["model.layers.0.mlp.experts.mxfp4.down_proj_blocks"] == (4, 64, 1, 16)
    assert_ranks_identical(results)
    assert_same_run(results[0], ref)


def test_dummy_weights_fill_the_kept_tensors(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--load-format dummy`` on an MXFP4 config: random codes, scales 0 (constant, as other
    quantized tensors' dummy scales), and the MoE layers run to finite outputs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config = ModelConfig(model=str(pair[0]), load_format="dummy", seed=3)
    model = load_model(config, CPU, torch.float32).model
    for experts in _experts(model):
        assert experts.mxfp4 is not None
        (b13, s13), (b2, s2) = experts.mxfp4.pairs()
        assert len(b13.unique()) > 200 and len(b2.unique()) > 200
        assert not s13.any() and not s2.any()
    x = torch.randn(5, GPT_OSS["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert all(torch.isfinite(block(x)).all() for block in _moe_blocks(model))


@pytest.mark.parametrize(
    ("scale", "code", "error"),
    [(255, 0, "NaN scale 255"), (254, 0x33, None), (254, 0x04, "2 \\*\\* 128"),
     (253, 0x55, None), (253, 0x60, "2 \\*\\* 128")],
)  # fmt: skip
def test_bad_scales_are_load_errors_naming_the_tensor(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    scale: int, code: int, error: str | None,
) -> None:  # fmt: skip
    """One block of layer 1's down projection given ``scale`` and every byte ``code``: a NaN
    scale or a value of 2 ** 128 (2.0 under 254, 4.0 under 253) fails the load naming the
    tensor; 1.5 under 254 and 3.0 under 253 load."""
    folder = tmp_path / "edited"
    shutil.copytree(pair[0], folder)
    (weights_file,) = folder.glob("*.safetensors")
    state = load_file(str(weights_file))
    prefix = "model.layers.1.mlp.experts.down_proj"
    state[f"{prefix}_scales"][2, 5, 1] = scale
    state[f"{prefix}_blocks"][2, 5, 1] = code
    save_file(state, str(weights_file), {"format": "pt"})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config = ModelConfig(model=str(folder))
    if error is None:
        assert _experts(load_model(config, CPU, torch.float32).model)[1].mxfp4 is not None
        return
    part = "scales" if scale == 255 else "blocks"
    with pytest.raises(
        ValueError, match=rf"layers\.1\.mlp\.experts\.mxfp4\.down_proj_{part}: .*{error}"
    ):
        load_model(config, CPU, torch.float32)


def test_keeps_only_where_triton_runs_and_blocks_are_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not keeps_mxfp4(True, 2880, 2880, 1)  # CPU without the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert keeps_mxfp4(True, 2880, 2880, 1) and keeps_mxfp4(True, 2880, 1440, 2)
    assert not keeps_mxfp4(False, 2880, 2880, 1)  # not an MXFP4 checkpoint
    assert not keeps_mxfp4(True, 2880, 720, 4)  # 720 = 22.5 blocks: de-quantized


def test_tp_rank_holds_its_rows_and_whole_down_blocks() -> None:
    """Rank 1 of 2 over I = 128 (H = 64): gate/up rows 128..255 of the interleaved tensor and
    down blocks 2..3 of 4."""
    loads = MXFP4Experts(4, 64, 128, start=64, local=64).shard_loads()
    gate_up, down = loads["gate_up_proj_blocks"][""], loads["down_proj_scales"][""]
    assert gate_up.full_shape == (4, 256, 2, 16) and gate_up.local_shape == (4, 128, 2, 16)
    assert (gate_up.split_dim, gate_up.start) == (1, 128)
    assert down.full_shape == (4, 64, 4) and down.local_shape == (4, 64, 2)
    assert (down.split_dim, down.start) == (2, 2)
