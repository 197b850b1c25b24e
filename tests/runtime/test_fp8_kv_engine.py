"""``--kv-cache-dtype fp8`` end to end on a tiny model: the cache holds 4x the float32 blocks in
the same budget, the engine reports it, and what the model computes through an e4m3 cache stays
equal to HF's float32 forward with the same rounding of K and V (prefill, decode and
prefix-cache hits).

The reference is HF transformers with one change: an attention function (registered through
``AttentionInterface``) that rounds every key and value through e4m3 with scale 1.0 (torch's
own cast, after rotary, as the cache stores them) before HF's sdpa attention. Attention over an
fp8 cache sees exactly those values, so the engine's logprobs (teacher-forced: HF runs the
engine's own tokens) agree to float32 rounding (``LOGPROB_TOL``), and every greedy pick is HF's
argmax. Against plain float32 K/V the same picks drift by up to ~0.3 nats on this tiny model
(its LM head is scaled up so logits are large); that is the format's rounding (3 mantissa
bits), which this reference factors out.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tokenwire.runtime.engine.core_loop import engine_info
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams

LOGPROB_TOL = 1e-3
PROMPTS = [
    [5, 17, 99, 230, 7, 41, 300, 12, 8, 77, 150],
    [5, 17, 99, 230, 7, 41, 300, 12, 9, 3, 200, 61, 14, 90, 33, 2, 18, 250, 71, 6],
]
BUDGET = 1 << 20


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def fp8_llm(model_dir: Path) -> LLM:
    return LLM(
        str(model_dir),
        device="cpu",
        max_model_len=256,
        kv_cache_dtype="fp8",
        kv_cache_memory=BUDGET,
        block_size=16,
    )


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)


def fp8_kv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's sdpa attention over keys and values rounded to e4m3 (scale 1.0)."""
    return sdpa_attention_forward(module, query, _e4m3(key), _e4m3(value), attention_mask, **kwargs)


AttentionInterface.register("tokenwire_fp8_kv", fp8_kv_attention)


def hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="tokenwire_fp8_kv"
    ).eval()
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_close_to_hf(model_dir: Path, prompt: list[int], llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    ref = hf_logprobs(model_dir, prompt + out.token_ids)
    assert out.logprobs is not None
    for pos, (token, position) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + pos]
        assert int(row.argmax()) == token, pos
        for tid, lp in position.items():
            assert abs(lp.logprob - row[tid].item()) < LOGPROB_TOL, (pos, tid)
    return out.token_ids


def test_fp8_cache_holds_four_times_the_float32_blocks(model_dir: Path, fp8_llm: LLM) -> None:
    fp32 = LLM(str(model_dir), device="cpu", max_model_len=256, kv_cache_memory=BUDGET)
    fp32_blocks = fp32.engine.kv_cache_manager.num_blocks
    fp8_blocks = fp8_llm.engine.kv_cache_manager.num_blocks
    assert fp8_blocks // 4 == fp32_blocks  # 4 bytes -> 1 per element, same budget
    cache = fp8_llm.engine.executor.worker.runner.kv_cache  # type: ignore[attr-defined]
    assert cache.dtype == torch.float8_e4m3fn
    assert engine_info(fp8_llm.engine).kv_cache_dtype == "fp8"
    assert engine_info(fp32.engine).kv_cache_dtype == "auto"


def test_fp8_greedy_logprobs_close_to_hf_float32(model_dir: Path, fp8_llm: LLM) -> None:
    for prompt in PROMPTS:
        assert_close_to_hf(model_dir, prompt, fp8_llm)
    assert not fp8_llm.engine.has_unfinished_requests()
    fp8_llm.engine.kv_cache_manager.check_invariants(idle=True)


def test_fp8_prefix_cache_hit_reads_the_stored_blocks(model_dir: Path, fp8_llm: LLM) -> None:
    """The second request's shared prefix comes from fp8 blocks written by the first."""
    first = assert_close_to_hf(model_dir, PROMPTS[1], fp8_llm)
    queries_before = fp8_llm.engine.kv_cache_manager.prefix_cache_hits
    second = assert_close_to_hf(model_dir, PROMPTS[1], fp8_llm)
    assert fp8_llm.engine.kv_cache_manager.prefix_cache_hits > queries_before
    assert second == first  # the cached prefix holds exactly what a fresh prefill computes
    fp8_llm.engine.kv_cache_manager.check_invariants(idle=True)
