"""Async scheduling (``--async-scheduling``): the engine plans step k+1 while step k runs, and
its greedy and seeded outputs equal synchronous scheduling's token for token, for every
feature it covers (stop tokens and strings, max_tokens, min_tokens, n > 1, penalties,
logprobs, prompt logprobs, chunked prefill, preemption, aborts, LoRA, the host and disk KV
tiers, embedding models; speculative decoding: test_async_spec.py). After every run the
engine is idle with every KV block free."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from embed_models import build_st_model
from engine_checks import assert_llm_idle
from peft_reference import write_adapter
from step_overlap import overlapped, run_aborting_b, steps_of

from tokenwire.runtime.core.kv_connector import OffloadingConnector
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.outputs import RequestOutput
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder

# Engine runs over several prompts and features: in make test, not in make test-fast.
pytestmark = pytest.mark.slow

PROMPTS: list[list[int]] = [
    [5, 6, 7, 8, 9],
    list(range(20, 61)),
    [11, 12, 13, 11, 12, 13, 11],
    [300, 301],
    list(range(100, 127)),
]

Run = tuple[list[list[list[int]]], LLM, StepRecorder]


def generate(
    model: Path,
    params: SamplingParams | list[SamplingParams],
    async_scheduling: bool,
    prompts: list[list[int]] = PROMPTS,
    **kwargs: Any,
) -> Run:
    llm = make_llm(model, async_scheduling, **kwargs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_llm_idle(llm)
    return [[c.token_ids for c in o.outputs] for o in outputs], llm, steps_of(llm)


def make_llm(model: Path, async_scheduling: bool, **kwargs: Any) -> LLM:
    observer = StepRecorder()
    return LLM(
        str(model), device="cpu", observer=observer, async_scheduling=async_scheduling, **kwargs
    )


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


FEATURES: dict[str, tuple[SamplingParams | list[SamplingParams], dict[str, Any]]] = {
    "greedy": (greedy(max_tokens=24), {}),
    "max_tokens_each": ([greedy(max_tokens=m) for m in (1, 2, 5, 17, 3)], {}),
    "seeded": (
        [SamplingParams(temperature=0.9, top_k=40, seed=i, max_tokens=20) for i in range(5)],
        {},
    ),
    "n_3_seeded": (SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12), {}),
    "penalties": (
        greedy(max_tokens=20, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
        {},
    ),
    "min_tokens": (greedy(max_tokens=20, min_tokens=6), {}),
    "chunked_prefill": (greedy(max_tokens=16), {"max_num_batched_tokens": 16}),
    "preemption": (
        greedy(max_tokens=40, ignore_eos=True),
        {"max_model_len": 128, "num_gpu_blocks_override": 10, "block_size": 16},
    ),
    "context_window": (greedy(max_tokens=None, ignore_eos=True), {"max_model_len": 64}),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_async_equals_sync(tiny_model_factory: Callable[..., Path], feature: str) -> None:
    model = tiny_model_factory("llama")
    params, kwargs = FEATURES[feature]
    sync, _, sync_rec = generate(model, params, False, **kwargs)
    fast, _, async_rec = generate(model, params, True, **kwargs)
    assert fast == sync
    assert overlapped(async_rec.steps) and not overlapped(sync_rec.steps)
    if feature == "preemption":
        assert sum(s.num_preemptions for s in async_rec.steps) > 0


def same_choices(fast: list[RequestOutput], sync: list[RequestOutput]) -> None:
    """Tokens, finish reasons, and sample and prompt logprobs (ranks exact, values within
    float noise: the two runs batch rows differently) are the same."""
    for f, s in zip(fast, sync, strict=True):
        assert same_logprobs(f.prompt_logprobs, s.prompt_logprobs)
        for fc, sc in zip(f.outputs, s.outputs, strict=True):
            assert (fc.token_ids, fc.finish_reason) == (sc.token_ids, sc.finish_reason)
            assert same_logprobs(fc.logprobs, sc.logprobs)


def same_logprobs(fast: Sequence[Any] | None, sync: Sequence[Any] | None) -> bool:
    if fast is None or sync is None:
        return fast is sync
    assert len(fast) == len(sync)
    for f, s in zip(fast, sync, strict=True):
        if f is None or s is None:
            assert f is s
            continue
        assert list(f) == list(s)
        assert all(abs(f[t].logprob - s[t].logprob) < 1e-4 for t in s)
    return True


# KV tiers: 16 usable device blocks of 4 tokens; A, B, C (30 tokens each) evict each other,
# so A's second run (A2) restores its prefix from the host tier (or the disk under it).
A, B, C = ([(i * k + 3) % 400 + 3 for i in range(30)] for k in (7, 11, 13))
TIER_PROMPTS = [A, B, C, [*A, 17, 18], [*B, 19]]
TIERS: dict[str, Any] = {
    "max_model_len": 64, "block_size": 4, "num_gpu_blocks_override": 17, "max_num_seqs": 2
}  # fmt: skip
HOST_BLOCK_GIB = 2 * 2 * 4 * 2 * 16 * 4 / (1 << 30)  # the tiny llama's block, float32


def run_lora(model: Path, tmp: Path, async_scheduling: bool) -> tuple[LLM, list[Any]]:
    """Two adapters and the base model in one batch; --max-loras 1 makes them take turns."""
    for seed, name in enumerate("ab"):
        if not (tmp / name).exists():
            write_adapter(model, tmp / name, rank=4 * (seed + 1), seed=seed + 1)
    modules = tuple((name, str(tmp / name)) for name in "ab")
    llm = make_llm(model, async_scheduling, enable_lora=True, lora_modules=modules, max_loras=1)
    loras = [llm.engine.get_lora(n) if n else None for n in ("a", None, "b", "a", "b")]
    params = greedy(max_tokens=12, logprobs=2)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    base = llm.generate(PROMPTS[:1], params, use_tqdm=False)  # adapter "a" changes it
    assert base[0].outputs[0].token_ids != outputs[0].outputs[0].token_ids
    return llm, outputs


def run_tiers(model: Path, tmp: Path, async_scheduling: bool, disk: bool) -> tuple[LLM, list[Any]]:
    kw: dict[str, Any] = {"kv_offloading_size": 0.01}
    if disk:  # a 2-block host tier: most evicted blocks go on to the disk
        path = tmp / f"kv-{async_scheduling}.disk"
        kw = {"kv_offloading_size": 2 * HOST_BLOCK_GIB, "kv_offloading_disk_path": str(path)}
        kw["kv_offloading_disk_size"] = 1 / 1024
    llm = make_llm(model, async_scheduling, **TIERS, **kw)
    params = greedy(max_tokens=6, logprobs=3, ignore_eos=True)
    outputs = llm.generate(TIER_PROMPTS, params, use_tqdm=False)
    connector = llm.engine.scheduler.connector
    assert isinstance(connector, OffloadingConnector)
    connector.check_invariants(idle=True)  # nothing pinned, queued or in flight
    stats = connector.stats()
    assert (stats.disk_blocks_loaded if disk else stats.blocks_loaded) > 0
    return llm, outputs


def run_prompt_logprobs(
    model: Path, tmp: Path, async_scheduling: bool, preempt: bool
) -> tuple[LLM, list[Any]]:
    """Prompt logprobs over chunked prefill, mixed with requests that do not ask for them;
    ``preempt``: in a device cache too small for all of them (requests restart)."""
    kw: dict[str, Any] = {"max_num_batched_tokens": 16}
    if preempt:
        kw |= {"max_model_len": 128, "num_gpu_blocks_override": 10, "block_size": 16}
    params = [
        greedy(max_tokens=40 if preempt else 8, logprobs=1, prompt_logprobs=p, ignore_eos=preempt)
        for p in (1, None, 3, 0, None)
    ]
    llm = make_llm(model, async_scheduling, **kw)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert (sum(s.num_preemptions for s in steps_of(llm).steps) > 0) == preempt
    return llm, outputs


# Chunked prefills (16-token budget) in a device cache of 8 usable 4-token blocks: requests
# wait for blocks. (Preempting an embedding request is covered in test_async_scheduler.py.)
SMALL_CHUNKED: dict[str, Any] = {
    "max_num_batched_tokens": 16, "block_size": 4, "num_gpu_blocks_override": 9, "max_model_len": 32
}  # fmt: skip


def run_embedding(
    tmp: Path, async_scheduling: bool, kind: str, **kwargs: Any
) -> tuple[LLM, list[Any]]:
    """Vectors of a tiny sentence-transformers model (MEAN pooling, over chunks for the
    decoder)."""
    folder = tmp / f"st-{kind}"
    if not folder.exists():
        build_st_model(kind, folder, "mean")
    llm = make_llm(folder, async_scheduling, **kwargs)
    texts = [f"{i} " + "the quick brown fox jumps over the lazy dog " * (i % 3) for i in range(9)]
    return llm, [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]


ENGINE_FEATURES: dict[str, Callable[[Path, Path, bool], tuple[LLM, list[Any]]]] = {
    "lora": run_lora,
    "host_kv_tier": lambda m, t, a: run_tiers(m, t, a, disk=False),
    "disk_kv_tier": lambda m, t, a: run_tiers(m, t, a, disk=True),
    "embedding_decoder": lambda m, t, a: run_embedding(t, a, "qwen3", **SMALL_CHUNKED),
    "embedding_encoder": lambda m, t, a: run_embedding(
        t, a, "bert", max_model_len=40, max_num_batched_tokens=40
    ),
    "prompt_logprobs": lambda m, t, a: run_prompt_logprobs(m, t, a, preempt=False),
    "prompt_logprobs_preempted": lambda m, t, a: run_prompt_logprobs(m, t, a, preempt=True),
}


@pytest.mark.parametrize("feature", list(ENGINE_FEATURES))
def test_async_equals_sync_with(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, feature: str
) -> None:
    """Engine features async steps cover: same tokens and logprobs, steps overlapped, and the
    engine idle afterwards with every block free (on every KV tier)."""
    model, run = tiny_model_factory("llama"), ENGINE_FEATURES[feature]
    (sync_llm, sync), (fast_llm, fast) = (run(model, tmp_path, a) for a in (False, True))
    if feature.startswith("embedding"):
        assert np.allclose(fast, sync, atol=1e-6) and len(fast) == 9
    else:
        same_choices(fast, sync)
    for llm, async_scheduling in ((sync_llm, False), (fast_llm, True)):
        assert_llm_idle(llm)
        assert overlapped(steps_of(llm).steps) == async_scheduling


def test_stop_token_ids_and_logprobs(tiny_model_factory: Callable[..., Path]) -> None:
    """A stop token taken from the greedy output ends requests mid-run (the step already
    planned after it is dropped); logprobs match too."""
    model = tiny_model_factory("llama")
    plain, _, _ = generate(model, greedy(max_tokens=20), False)
    stops = tuple({o[0][len(o[0]) // 2] for o in plain})
    params = greedy(max_tokens=20, stop_token_ids=stops, logprobs=2)
    llm_outputs = []
    for async_scheduling in (False, True):
        llm = LLM(str(model), device="cpu", async_scheduling=async_scheduling)
        llm_outputs.append(llm.generate(PROMPTS, params, use_tqdm=False))
        assert_llm_idle(llm)
    sync, fast = llm_outputs
    assert any(o.outputs[0].stop_reason in stops for o in sync)
    for s, f in zip(sync, fast, strict=True):
        assert f.outputs[0].token_ids == s.outputs[0].token_ids
        assert f.outputs[0].finish_reason == s.outputs[0].finish_reason
        assert f.outputs[0].stop_reason == s.outputs[0].stop_reason
        s_lps, f_lps = s.outputs[0].logprobs, f.outputs[0].logprobs
        assert s_lps is not None and f_lps is not None
        assert [list(p) for p in f_lps] == [list(p) for p in s_lps]


def test_stop_strings(tiny_model_with_tokenizer: Path) -> None:
    """A stop string (the front's detokenizer ends the request) gives the same text."""
    model = tiny_model_with_tokenizer
    base = LLM(str(model), device="cpu").generate(["Hello there"], greedy(max_tokens=24))
    text = base[0].outputs[0].text
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    assert stop
    params = greedy(max_tokens=24, stop=(stop,))
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(model), device="cpu", async_scheduling=async_scheduling)
        out = llm.generate(["Hello there", "Once upon"], params, use_tqdm=False)
        results.append([(o.outputs[0].text, o.outputs[0].token_ids) for o in out])
        assert_llm_idle(llm)
    assert results[0] == results[1]
    assert results[0][0][0] != text  # it stopped early


def run_with_abort(model: Path, async_scheduling: bool) -> dict[str, list[int]]:
    """Three requests; after a few steps "b" is aborted, the rest run to the end."""
    llm = LLM(str(model), device="cpu", async_scheduling=async_scheduling)
    tokens = run_aborting_b(llm, PROMPTS, greedy(max_tokens=16, ignore_eos=True))
    kv = llm.engine.kv_cache_manager
    kv.check_invariants(idle=True)
    assert kv.num_free_blocks == kv.num_blocks
    return tokens


def test_abort_mid_run(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory("llama")
    sync, fast = run_with_abort(model, False), run_with_abort(model, True)
    assert fast["a"] == sync["a"] and fast["c"] == sync["c"] and len(sync["a"]) == 16
    assert 0 < len(fast["b"]) < 16 and fast["b"] == sync["b"][: len(fast["b"])]


def test_abort_everything_leaves_the_engine_idle(tiny_model_factory: Callable[..., Path]) -> None:
    """Aborting the last requests while a step is in flight drains it: idle at once."""
    llm = LLM(str(tiny_model_factory("llama")), device="cpu", async_scheduling=True)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy(max_tokens=30))
    for _ in range(3):
        engine.step()
    engine.abort_requests([str(i) for i in range(len(PROMPTS))])
    assert_llm_idle(llm)
    # And it serves again afterwards, as a synchronous engine would.
    again = llm.generate([PROMPTS[0]], greedy(max_tokens=8), use_tqdm=False)
    sync = LLM(str(tiny_model_factory("llama")), device="cpu").generate(
        [PROMPTS[0]], greedy(max_tokens=8), use_tqdm=False
    )
    assert again[0].outputs[0].token_ids == sync[0].outputs[0].token_ids
    assert_llm_idle(llm)
