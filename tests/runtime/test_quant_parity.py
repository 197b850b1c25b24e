"""Quantized weights end to end: greedy tokens equal HF transformers ``generate()`` token for
token (CPU, float32) when HF runs the same model with the weights de-quantized by the
independent reference in ``quant_checkpoints`` — GPTQ (symmetric and asymmetric, groups
32/64/128 and channelwise, act order on and off, v1 and v2 zero points, 8-bit), AWQ (GEMM
packing, groups 32/64/128), online int8 of an unquantized checkpoint; a Qwen2 model (qkv
bias, tied embeddings) with act-order GPTQ; and tensor parallelism (two gloo ranks) with
GPTQ weights equal to TP=1 (groups split over the row-parallel ranks, and act order with
every group kept on each rank).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_checks import assert_llm_idle
from parity import NEW_TOKENS, distinct_prompts, hf_greedy
from quant_checkpoints import GPTQSpec, int8_reference, write_awq, write_gptq, write_hf_reference

from tokenwire.runtime.engine.core_loop import engine_info
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams

PROMPTS = distinct_prompts()[:5]
# K = 128 (q/k/v, o, gate/up) and 256 (down): every group size divides every input.
LLAMA = {"hidden_size": 128, "intermediate_size": 256}

GPTQ_CASES: dict[str, GPTQSpec] = {
    "sym-g128-zero-biases": GPTQSpec(group_size=128, zero_biases=True),
    "asym-g128": GPTQSpec(group_size=128, sym=False),
    "sym-g64": GPTQSpec(group_size=64),
    "asym-g32": GPTQSpec(group_size=32, sym=False),
    "sym-g32-act-order": GPTQSpec(group_size=32, desc_act=True),
    "asym-g64-act-order": GPTQSpec(group_size=64, sym=False, desc_act=True),
    "asym-g128-act-order-v2": GPTQSpec(sym=False, desc_act=True, checkpoint_format="gptq_v2"),
    "asym-channelwise": GPTQSpec(group_size=-1, sym=False),
    "8bit-sym-g64": GPTQSpec(bits=8, group_size=64),
}


def greedy(path: Path, **kwargs: Any) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device="cpu", dtype="float32", num_gpu_blocks_override=64, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


def reference(src: Path, state: dict[str, Any], out: Path) -> list[list[int]]:
    return hf_greedy(write_hf_reference(src, state, out), PROMPTS)


@pytest.fixture(scope="module")
def llama(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", **LLAMA)


@pytest.mark.parametrize("case", list(GPTQ_CASES))
def test_gptq_greedy_equals_hf_on_dequantized_weights(
    case: str, llama: Path, tmp_path: Path
) -> None:
    state = write_gptq(llama, tmp_path / "gptq", GPTQ_CASES[case])
    expected = reference(llama, state, tmp_path / "hf")
    got, llm = greedy(tmp_path / "gptq")
    assert got == expected, case
    assert llm.engine.facts.quantization == "gptq"
    assert_llm_idle(llm)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_greedy_equals_hf_on_dequantized_weights(
    group_size: int, llama: Path, tmp_path: Path
) -> None:
    state = write_awq(llama, tmp_path / "awq", group_size)
    expected = reference(llama, state, tmp_path / "hf")
    got, llm = greedy(tmp_path / "awq")
    assert got == expected
    assert llm.engine.facts.quantization == "awq"


def test_int8_online_greedy_equals_hf_on_dequantized_weights(llama: Path, tmp_path: Path) -> None:
    expected = reference(llama, int8_reference(llama), tmp_path / "hf")
    got, llm = greedy(llama, quantization="int8")
    assert got == expected
    assert engine_info(llm.engine).quantization == "int8"


def test_qwen2_bias_tied_embeddings_gptq_act_order(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    src = tiny_model_factory("qwen2", hidden_size=64, num_attention_heads=4)  # qkv bias, tied
    spec = GPTQSpec(group_size=32, sym=False, desc_act=True, zero_biases=True)
    state = write_gptq(src, tmp_path / "gptq", spec)
    got, _ = greedy(tmp_path / "gptq")
    assert got == reference(src, state, tmp_path / "hf")


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec",
    [
        GPTQSpec(group_size=32, sym=False),  # o/down: each rank holds its groups
        GPTQSpec(group_size=64, sym=False, desc_act=True),  # o/down: every group on each rank
    ],
    ids=["asym-g32", "asym-g64-act-order"],
)
def test_tp2_gptq_equals_tp1_and_hf(spec: GPTQSpec, llama: Path, tmp_path: Path) -> None:
    state = write_gptq(llama, tmp_path / "gptq", spec)
    expected = reference(llama, state, tmp_path / "hf")
    one, _ = greedy(tmp_path / "gptq")
    assert one == expected
    with LLM(
        str(tmp_path / "gptq"),
        device="cpu",
        dtype="float32",
        tensor_parallel_size=2,
        num_gpu_blocks_override=64,
    ) as two:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
        outputs = two.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert two.engine.facts.quantization == "gptq"
        assert two.engine.facts.tensor_parallel_size == 2
        assert_llm_idle(two)
