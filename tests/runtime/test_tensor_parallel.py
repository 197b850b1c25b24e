"""Tensor parallelism end to end on CPU (gloo, real worker processes): TP=2 greedy tokens equal
TP=1 and HF ``generate()`` token for token for every family, with KV-head replication, a
vocabulary not divisible by 2 and tied embeddings; logprobs within 1e-4 of TP=1; prefix
caching and preemption under TP=2; a missing peer fails startup after a bounded wait."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_checks import assert_llm_idle
from parity import NEW_TOKENS, distinct_prompts, hf_greedy, shared_prefix_prompts

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder

pytestmark = pytest.mark.slow

# (family, config overrides): every family, plus KV heads replicated over the ranks (1 KV
# head, TP 2), an odd vocabulary, and tied embeddings (Qwen2/Qwen3's tiny configs tie).
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral-1-kv-head": ("mistral", {}),  # its tiny config has one KV head
    "qwen2-tied-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "llama-tied-odd-vocab-1-kv-head": (
        "llama",
        {"tie_word_embeddings": True, "num_key_value_heads": 1, "vocab_size": 511},
    ),
}
PROMPTS = distinct_prompts()[:6]
LOGPROBS = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=2)


def tp_llm(path: Path, tp: int, **kwargs: Any) -> LLM:
    return LLM(str(path), device="cpu", tensor_parallel_size=tp, **kwargs)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module", params=list(CASES))
def case(
    request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]
) -> Iterator[tuple[str, Path, LLM, LLM]]:
    family, overrides = CASES[request.param]
    path = tiny_model_factory(family, **overrides)
    one, two = tp_llm(path, 1), tp_llm(path, 2)
    yield request.param, path, one, two
    two.shutdown()


def test_tp2_greedy_equals_tp1_and_hf(case: tuple[str, Path, LLM, LLM]) -> None:
    name, path, one, two = case
    assert two.engine.facts.tensor_parallel_size == 2
    expected = hf_greedy(path, PROMPTS)
    assert greedy(one, PROMPTS) == expected, name
    assert greedy(two, PROMPTS) == expected, name
    assert_llm_idle(two)


def test_tp2_logprobs_and_seeded_sampling_equal_tp1(case: tuple[str, Path, LLM, LLM]) -> None:
    _, _, one, two = case
    a = one.generate(PROMPTS[:3], LOGPROBS, use_tqdm=False)
    b = two.generate(PROMPTS[:3], LOGPROBS, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        cx, cy = x.outputs[0], y.outputs[0]
        assert cx.token_ids == cy.token_ids
        assert cx.logprobs is not None and cy.logprobs is not None
        for px, py in zip(cx.logprobs, cy.logprobs, strict=True):
            assert list(px) == list(py)  # same tokens, same ranks
            assert all(abs(px[t].logprob - py[t].logprob) < 1e-4 for t in px)
        assert x.prompt_logprobs is not None and y.prompt_logprobs is not None
        for px, py in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], strict=True):
            assert px is not None and py is not None
            assert all(abs(px[t].logprob - py[t].logprob) < 1e-4 for t in px)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=12, n=2)
    sa = one.generate(PROMPTS[:2], seeded, use_tqdm=False)
    sb = two.generate(PROMPTS[:2], seeded, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in sa] == [
        [c.token_ids for c in o.outputs] for o in sb
    ]
    assert_llm_idle(two)


def test_tp2_prefix_caching_and_preemption(tiny_model_factory: Callable[..., Path]) -> None:
    path = tiny_model_factory("llama")
    expected_shared = hf_greedy(path, shared_prefix_prompts())
    expected = hf_greedy(path, distinct_prompts())
    with tp_llm(path, 2) as cached:
        first = greedy(cached, shared_prefix_prompts())
        second = cached.generate(
            shared_prefix_prompts(),
            SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS),
            use_tqdm=False,
        )
        assert first == expected_shared
        assert [o.outputs[0].token_ids for o in second] == expected_shared
        assert all(o.num_cached_tokens >= 32 for o in second)
        assert_llm_idle(cached)
    recorder = StepRecorder()
    with tp_llm(path, 2, observer=recorder, num_gpu_blocks_override=13, max_model_len=128) as tight:
        assert greedy(tight, distinct_prompts()) == expected
        assert sum(s.num_preemptions for s in recorder.steps) > 0
        # Every step's all-reduces and logits gather are timed on rank 0 (step spans).
        assert all(0 < s.collective_time < s.forward_time + s.sample_time for s in recorder.steps)
        assert_llm_idle(tight)


def test_missing_peer_fails_startup_after_a_bounded_wait(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """Node 0 of two, with no node 1: a clear error naming the flags, within the timeout."""
    path = tiny_model_factory("llama")
    code = (
        "import sys; from tokenwire.server.cli import main; "
        f"sys.exit(main(['generate', 'hi', '--model', {str(path)!r}, '--device', 'cpu', "
        "'--tensor-parallel-size', '2', '--nnodes', '2', '--master-port', '29731', "
        "'--distributed-startup-timeout', '3']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "could not join the tensor-parallel group" in done.stderr
    assert "--nnodes" in done.stderr


def test_tp3_default_model_layout_with_chunked_prefill(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """SmolLM2's head layout (9 query heads, 3 KV heads) at TP=3, the smallest split it
    allows, with prompts prefilled in chunks of a 16-token budget."""
    path = tiny_model_factory(
        "llama", hidden_size=72, intermediate_size=144, num_attention_heads=9,
        num_key_value_heads=3,
    )  # fmt: skip
    prompts = distinct_prompts()[:4]
    expected = hf_greedy(path, prompts)
    recorder = StepRecorder()
    with tp_llm(path, 3, observer=recorder, max_num_batched_tokens=16) as llm:
        assert greedy(llm, prompts) == expected
        assert any(s.phase == "mixed" for s in recorder.steps)
        assert_llm_idle(llm)
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        tp_llm(path, 2)  # 9 heads do not split over 2 ranks
