"""gpt-oss MXFP4 checkpoints (the published gpt-oss-20b/120b layout), de-quantized at load.

The de-quantizer (``runtime/models/mxfp4.py``) is bit-exact against transformers'
``convert_moe_packed_tensors`` and against an independent oracle written from the OCP MX spec
(E2M1 decoded from its sign/exponent/mantissa bits, E8M0 as ``2.0 ** (s - 127)`` in float64),
random codes and every scale incl. the extremes; NaN scales, overflowing blocks and malformed
pairs are errors naming the tensor; the kept-quantized linear reference (per-block dot
products, scaled afterwards) equals the de-quantized matmul. End to end: a tiny random
gpt-oss whose experts are quantized to MXFP4 (``tests/support/mxfp4_checkpoint.py``) loads
with its ``quantization_config`` into exactly the weights of the same model saved
de-quantized (float32 and bfloat16), which is also what transformers' own
``Mxfp4Config(dequantize=True)`` loads; engine greedy tokens equal HF ``generate()`` on the
de-quantized model, logprobs within 1e-3; TP=2 gloo ranks equal TP=1; a missing
``*_scales`` tensor is a load error naming it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_checks import assert_llm_idle
from forward_inputs import hf_logits
from mxfp4_checkpoint import MXFP4_CONFIG, quantize_mxfp4, write_mxfp4_pair
from parity import distinct_prompts, hf_greedy
from safetensors.torch import load_file, save_file
from tiny_models import build_tiny_model
from tp_ranks import GlooRanks, assert_ranks_identical, assert_same_run, run_rank
from transformers import AutoModelForCausalLM

from tokenwire.runtime.config import ModelConfig
from tokenwire.runtime.distributed.group import TPGroup
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.loader.model_loader import load_model
from tokenwire.runtime.models.gpt_oss_checkpoint import split_gpt_oss_experts
from tokenwire.runtime.models.layers.quant.registry import resolve_quant_config
from tokenwire.runtime.models.mxfp4 import dequantize_mxfp4, e8m0_to_float32, mxfp4_linear_ref
from tokenwire.runtime.sampling_params import SamplingParams

# hidden and intermediate sizes are multiples of the 32-value MXFP4 block.
GPT_OSS: dict[str, Any] = dict(
    model_type="gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    num_local_experts=4, num_experts_per_tok=2, sliding_window=8, swiglu_limit=3.0,
    rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
)  # fmt: skip
GPT_OSS_CONFIG = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (so -0.0 != 0.0) of a float32 or bfloat16 tensor."""
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _random_pair(seed: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes and scales 0..252; the first blocks take the extreme scales 0, 1, 127,
    252, 253, 254 (the last two with codes below 2 in magnitude: larger ones overflow)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 253, shape, generator=gen, dtype=torch.uint8)
    extremes = torch.tensor([0, 1, 127, 252, 253, 254], dtype=torch.uint8)[: scales.numel()]
    scales.view(-1)[: len(extremes)] = extremes
    flat = blocks.view(-1, 16)
    flat[(scales.view(-1) >= 253)] &= 0xBB  # clear each nibble's top exponent bit: |v| < 2
    return blocks, scales


def _spec_oracle(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OCP MX v1.0: element 2k in the low nibble, E2M1 = sign | exp(2) | mantissa(1), bias 1,
    subnormal at exp 0; E8M0 = 2^(s - 127). Computed in float64, one element at a time."""
    out = np.empty((*scales.shape, 32), dtype=np.float64)
    for index in np.ndindex(*scales.shape):
        scale = 2.0 ** (int(scales[index]) - 127)
        for j in range(32):
            code = (int(blocks[index][j // 2]) >> (4 * (j % 2))) & 0xF
            sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
            mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
            out[index][j] = (-mag if sign else mag) * scale
    return out.reshape(*scales.shape[:-1], -1)


# ----------------------------------------------------------------------------- the format
def test_dequantize_matches_transformers_bit_exact() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_pair(0, (3, 40, 5))  # [E, out, in / 32]
    ours = dequantize_mxfp4(blocks, scales)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        assert torch.equal(_bits(ours.to(dtype)), _bits(theirs))  # -0.0 included
    assert ours.shape == (3, 40, 160) and ours.dtype == torch.float32


def test_dequantize_matches_the_spec_oracle_bit_exact() -> None:
    blocks, scales = _random_pair(1, (6, 7))
    oracle = torch.from_numpy(_spec_oracle(blocks.numpy(), scales.numpy()).astype(np.float32))
    got = dequantize_mxfp4(blocks, scales)
    assert torch.equal(_bits(got), _bits(oracle))  # -0.0 included
    assert (got == 0).any() and (got.abs() < 2.0**-120).any() and (got.abs() > 2.0**120).any()


def test_e8m0_extremes_are_exact() -> None:
    scales = torch.tensor([0, 1, 126, 127, 128, 254], dtype=torch.uint8)
    want = torch.tensor([2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127], dtype=torch.float64)
    assert torch.equal(e8m0_to_float32(scales).double(), want)
    # The largest finite products under scale 254 / smallest under scale 0 survive in bf16.
    blocks = torch.tensor([[0x31, *[0] * 15]], dtype=torch.uint8)  # 0.5, 1.5
    for scale, (a, b) in ((254, (2.0**126, 1.5 * 2.0**127)), (0, (2.0**-128, 1.5 * 2.0**-127))):
        got = dequantize_mxfp4(blocks, torch.tensor([scale], dtype=torch.uint8))
        assert got[:2].double().tolist() == [a, b] == got[:2].bfloat16().double().tolist()


def test_quantize_round_trips_its_own_grid() -> None:
    blocks, scales = _random_pair(2, (4, 3))
    again = quantize_mxfp4(dequantize_mxfp4(blocks, scales))
    assert torch.equal(dequantize_mxfp4(*again), dequantize_mxfp4(blocks, scales))


def test_kept_quantized_linear_reference_equals_the_dequantized_matmul() -> None:
    """Block dot products on raw E2M1 values, scaled per block afterwards (float64 so the
    different summation order stays far below the tolerance)."""
    gen = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (24, 3, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(115, 135, (24, 3), generator=gen, dtype=torch.uint8)
    x, bias = torch.randn(2, 5, 96, generator=gen, dtype=torch.float64), torch.randn(24)
    got = mxfp4_linear_ref(x, blocks, scales, bias.double())
    want = x @ dequantize_mxfp4(blocks, scales).double().T + bias.double()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"x \[\.\.\., 64\] does not match MXFP4 blocks"):
        mxfp4_linear_ref(x[..., :64], blocks, scales)


@pytest.mark.parametrize(
    ("blocks", "scales", "match"),
    [
        (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.full((2, 3), 255, dtype=torch.uint8),
         r"'w_scales' holds the E8M0 NaN scale 255"),
        (torch.full((1, 1, 16), 0x77, dtype=torch.uint8),
         torch.full((1, 1), 254, dtype=torch.uint8), r"'w_blocks' has values of 2 \*\* 128"),
        (torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8),
         r"'w_blocks' has shape \(2, 3, 8\)"),
        (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8),
         r"'w_scales' has shape \(2, 4\): expected \(2, 3\)"),
        (torch.zeros(2, 3, 16), torch.zeros(2, 3, dtype=torch.uint8),
         r"'w_blocks' has dtype torch.float32, expected uint8"),
    ],
)  # fmt: skip
def test_bad_pairs_name_the_tensor(blocks: torch.Tensor, scales: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dequantize_mxfp4(blocks, scales, "w_blocks")


def test_split_pairs_blocks_and_scales_in_any_order() -> None:
    """Scales before blocks, another tensor between: gate/up rows de-interleaved per expert."""
    blocks, scales = _random_pair(3, (2, 6, 1))  # 2 experts, 2 * I = 6 rows, H = 32
    base = "model.layers.1.mlp.experts.gate_up_proj"
    bias = ("model.layers.1.mlp.router.bias", torch.zeros(2))
    split = dict(
        split_gpt_oss_experts([(f"{base}_scales", scales), bias, (f"{base}_blocks", blocks)])
    )
    full = dequantize_mxfp4(blocks, scales)
    assert torch.equal(split["model.layers.1.mlp.experts.1.gate_proj.weight"], full[1][0::2])
    assert torch.equal(split["model.layers.1.mlp.experts.1.up_proj.weight"], full[1][1::2])
    assert "model.layers.1.mlp.gate.bias" in split and len(split) == 5


@pytest.mark.parametrize("suffix", ["_blocks", "_scales"])
def test_split_without_the_partner_names_it(suffix: str) -> None:
    blocks, scales = _random_pair(4, (1, 2, 1))
    name = "model.layers.0.mlp.experts.down_proj" + suffix
    with pytest.raises(ValueError, match=rf"{name!r} has no 'model.*down_proj_"):
        list(split_gpt_oss_experts([(name, blocks if suffix == "_blocks" else scales)]))


def test_quantization_config_is_accepted_for_gpt_oss_only() -> None:
    config = {**GPT_OSS_CONFIG, "quantization_config": MXFP4_CONFIG}
    assert resolve_quant_config(None, config) is None  # experts de-quantized: runs unquantized
    with pytest.raises(ValueError, match=r"--quantization int8 contradicts .* mxfp4"):
        resolve_quant_config("int8", config)
    llama = {"model_type": "llama", "quantization_config": MXFP4_CONFIG}
    with pytest.raises(ValueError, match=r"quant_method='mxfp4' is supported for gpt-oss"):
        resolve_quant_config(None, llama)
    bad = {**config, "quantization_config": {**MXFP4_CONFIG, "modules_to_not_convert": "lm_head"}}
    with pytest.raises(ValueError, match=r"quantization_config\.modules_to_not_convert"):
        resolve_quant_config(None, bad)


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(MXFP4 checkpoint, the same model with its experts de-quantized)."""
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    return write_mxfp4_pair(build_tiny_model("llama", root / "src", **GPT_OSS), root)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loads_exactly_the_dequantized_weights(pair: tuple[Path, Path], dtype: torch.dtype) -> None:
    mxfp4, reference = pair
    got = load_model(ModelConfig(model=str(mxfp4)), torch.device("cpu"), dtype)
    want = load_model(ModelConfig(model=str(reference)), torch.device("cpu"), dtype)
    assert got.quantization is None
    got_state, want_state = got.model.state_dict(), want.model.state_dict()
    assert got_state.keys() == want_state.keys()
    assert all(torch.equal(got_state[k], want_state[k]) for k in got_state)
    assert any(".w13" in k for k in got_state) and any(".w2" in k for k in got_state)


def test_transformers_dequantizes_to_the_same_reference(pair: tuple[Path, Path]) -> None:
    from transformers import Mxfp4Config

    mxfp4, reference = pair
    theirs = AutoModelForCausalLM.from_pretrained(
        mxfp4, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).state_dict()
    want = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).state_dict()
    assert theirs.keys() == want.keys()
    assert all(torch.equal(theirs[k], want[k]) for k in want)


def test_greedy_tokens_and_logprobs_match_hf(pair: tuple[Path, Path]) -> None:
    mxfp4, reference = pair
    prompts = distinct_prompts()
    expected = hf_greedy(reference, prompts)
    llm = LLM(str(mxfp4), device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=len(expected[0]), logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert len({tuple(t) for t in expected}) > 1
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    for prompt, out in zip(prompts[:3], outputs[:3], strict=True):
        tokens = [*prompt, *out.outputs[0].token_ids]
        with torch.inference_mode():
            ref = torch.log_softmax(hf_logits(hf, tokens), dim=-1)
        for i, token in enumerate(out.outputs[0].token_ids):
            got = out.outputs[0].logprobs[i][token].logprob
            assert abs(got - float(ref[len(prompt) - 1 + i, token])) < 1e-3
    assert_llm_idle(llm)


def test_missing_scales_is_a_load_error_naming_it(pair: tuple[Path, Path], tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    shutil.copytree(pair[0], folder)
    (weights_file,) = folder.glob("*.safetensors")
    state = load_file(str(weights_file))
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, str(weights_file), {"format": "pt"})
    with pytest.raises(
        ValueError, match=r"down_proj_blocks' has no '.*layers\.1.*down_proj_scales"
    ):
        load_model(ModelConfig(model=str(folder)), torch.device("cpu"), torch.float32)


def test_tp2_gloo_ranks_match_tp1_on_the_dequantized_model(pair: tuple[Path, Path]) -> None:
    """Each rank de-quantizes whole experts and keeps its slice of them."""
    mxfp4, reference = pair
    ref = run_rank(TPGroup.single(), str(reference))
    pool = GlooRanks(2)
    try:
        results = pool.run(run_rank, str(mxfp4))
    finally:
        pool.close()
    assert_ranks_identical(results)
    assert_same_run(results[0], ref)
