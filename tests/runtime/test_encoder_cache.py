"""The encoder-output cache and the encoder budget (``core.encoder_cache``,
``worker.image_embeds``) in the offline engine, on the tiny random LLaVA: a repeated image
(in a later request, twice in one request) is encoded once and gives the greedy tokens and
logprobs of a fresh engine per prompt; more distinct images than the cache holds evict (never
one a running prefill needs) with the same outputs; the per-step budget splits encoder work
over steps without changing them; an image larger than the cache is refused. Prefix caching
is off wherever a repeat must reach the encoder cache (a prefix hit skips the encoder)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_checks import assert_llm_idle
from PIL import Image
from tiny_llava import IMAGE_TOKEN, PATCHES, save_tiny_llava, synthetic_image

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder
from tokenwire.runtime.worker.image_embeds import ImageEmbeds

NEW_TOKENS = 6
ONE = [1, 3, 4, 5, IMAGE_TOKEN, 30, 31]
TWO = [1, 40, 41, IMAGE_TOKEN, 42, 43, IMAGE_TOKEN, 44]
Case = tuple[list[int], list[Image.Image]]
Result = tuple[list[int], list[list[tuple[int, float]]]]
Reference = Callable[[list[Case]], list[Result]]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llava(tmp_path_factory.mktemp("llava"))


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=3)


def _results(outputs: list[Any]) -> list[Result]:
    results = []
    for output in outputs:
        completion = output.outputs[0]
        lps = [sorted((t, lp.logprob) for t, lp in step.items()) for step in completion.logprobs]
        results.append((list(completion.token_ids), lps))
    return results


def _run(llm: LLM, cases: list[Case]) -> list[Result]:
    prompts = [
        {"prompt_token_ids": t, "multi_modal_data": {"image": i}} if i else t for t, i in cases
    ]
    return _results(llm.generate(prompts, _params(), use_tqdm=False))


@pytest.fixture(scope="module")
def reference(llava_dir: Path) -> Reference:
    """Each prompt alone in a fresh engine (every image encoded for it), remembered."""
    memo: dict[tuple[tuple[int, ...], tuple[bytes, ...]], Result] = {}

    def results(cases: list[Case]) -> list[Result]:
        out = []
        for case in cases:
            key = (tuple(case[0]), tuple(image.tobytes() for image in case[1]))
            if key not in memo:
                llm = LLM(str(llava_dir), device="cpu", enable_prefix_caching=False)
                memo[key] = _run(llm, [case])[0]
                llm.shutdown()
            out.append(memo[key])
        return out

    return results


def _assert_same(got: list[Result], want: list[Result]) -> None:
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for step, want_step in zip(lps, want_lps, strict=True):
            assert [t for t, _ in step] == [t for t, _ in want_step]
            assert [lp for _, lp in step] == pytest.approx([lp for _, lp in want_step], abs=1e-4)


def _engine(path: Path, **kwargs: Any) -> tuple[LLM, StepRecorder]:
    recorder = StepRecorder()
    kwargs.setdefault("enable_prefix_caching", False)
    return LLM(str(path), device="cpu", observer=recorder, **kwargs), recorder


def _embeds(llm: LLM) -> ImageEmbeds:
    images = llm.engine.executor.worker.runner.images  # type: ignore[attr-defined]
    assert isinstance(images, ImageEmbeds)
    return images


def _assert_idle(llm: LLM) -> None:
    """Idle engine, every KV block free, no image referenced, worker and book agree."""
    assert_llm_idle(llm)
    book = llm.engine.scheduler.encoder
    assert book.num_referenced() == 0
    assert book.used <= book.capacity
    assert _embeds(llm).cached_tokens == book.used
    llm.shutdown()


def _encoded(recorder: StepRecorder) -> int:
    return sum(s.num_images_encoded for s in recorder.steps)


def _hits(recorder: StepRecorder) -> int:
    return sum(s.num_encoder_cache_hits for s in recorder.steps)


A, B = synthetic_image(1), synthetic_image(2)


def test_a_repeated_image_is_encoded_once(llava_dir: Path, reference: Reference) -> None:
    cases = [(ONE, [A]), (ONE, [A]), (TWO, [A, A]), (TWO, [B, A])]
    want = reference(cases)
    llm, recorder = _engine(llava_dir)
    _assert_same(_run(llm, cases[:1]), want[:1])  # A encoded
    _assert_same(_run(llm, cases[1:3]), want[1:3])  # later requests, and twice in one
    assert (_encoded(recorder), _hits(recorder)) == (1, 3)
    _assert_same(_run(llm, cases[3:]), want[3:])  # B new, A still cached
    assert (_encoded(recorder), _hits(recorder)) == (2, 4)
    assert _embeds(llm).num_encoded_total == 2
    _assert_idle(llm)


def test_the_cache_keeps_its_bound(llava_dir: Path, reference: Reference) -> None:
    """Room for two images: six distinct ones (and repeats) evict, outputs unchanged; in a
    batch, prompts wait for room rather than evict features a prefill still reads."""
    images = [synthetic_image(10 + i) for i in range(6)]
    cases: list[Case] = [(ONE, [im]) for im in [*images, images[0]]]
    cases += [(TWO, [images[1], images[2]])]
    want = reference(cases)
    llm, recorder = _engine(llava_dir, encoder_cache_size=2 * PATCHES)
    for case, expected in zip(cases, want, strict=True):  # one at a time
        _assert_same(_run(llm, [case]), [expected])
        assert _embeds(llm).cached_tokens <= 2 * PATCHES
    assert _encoded(recorder) == 9  # images[0] came back after eviction; then 1 and 2
    assert llm.engine.scheduler.encoder.num_evictions_total == 7
    _assert_same(_run(llm, cases), want)  # all at once: no more than two images a step
    assert max(s.num_images_encoded for s in recorder.steps) <= 2
    _assert_idle(llm)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_the_encoder_budget_splits_work_across_steps(
    llava_dir: Path, reference: Reference, chunked: bool
) -> None:
    """One image's worth of encoder work per step: the batch's four distinct images are
    encoded over several steps (a whole prompt's two images together in the step it runs,
    as its first work, without chunked prefill) and the outputs do not change."""
    cases: list[Case] = [
        (TWO, [synthetic_image(20), synthetic_image(21)]),
        (ONE, [synthetic_image(22)]),
        (ONE, [synthetic_image(23)]),
    ]
    want = reference(cases)
    llm, recorder = _engine(
        llava_dir, max_num_encoder_input_tokens=PATCHES, enable_chunked_prefill=chunked
    )
    _assert_same(_run(llm, cases), want)
    per_step = [s.num_images_encoded for s in recorder.steps if s.num_images_encoded]
    assert sum(per_step) == 4
    assert per_step == ([1, 1, 1, 1] if chunked else [2, 1, 1])
    _assert_idle(llm)


def test_an_image_larger_than_the_cache_is_refused(llava_dir: Path, reference: Reference) -> None:
    llm, _ = _engine(llava_dir, encoder_cache_size=PATCHES - 1)
    with pytest.raises(ParameterError, match="--encoder-cache-size"):
        _run(llm, [(ONE, [A])])
    _assert_idle(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_and_async_steps(
    llava_dir: Path, reference: Reference, async_scheduling: bool
) -> None:
    """Few KV blocks (preemption by recompute finds its images again: a hit or encoded anew),
    chunked prefill splitting image runs, a cache of three images, one step in flight."""
    images = [synthetic_image(30 + i) for i in range(4)]
    cases: list[Case] = [(TWO, [images[i], images[(i + 1) % 4]]) for i in range(4)]
    cases.append((ONE, [images[0]]))
    want = reference(cases)
    llm, recorder = _engine(
        llava_dir,
        num_gpu_blocks_override=6,
        max_model_len=64,
        max_num_batched_tokens=24,
        encoder_cache_size=3 * PATCHES,
        async_scheduling=async_scheduling,
    )
    _assert_same(_run(llm, cases), want)
    assert sum(s.num_preemptions for s in recorder.steps) > 0
    assert _encoded(recorder) >= 4
    _assert_idle(llm)


def test_a_cache_salt_gets_its_own_encoder_outputs(llava_dir: Path, reference: Reference) -> None:
    """Image A under salts x, y, x and unsalted: y's and the unsalted request encode A again
    (no hit on another salt's features: a tenant's TTFT reveals nothing of another's
    images), x's second request hits; every output is the fresh engine's."""
    want = reference([(ONE, [A])])[0]
    llm, recorder = _engine(llava_dir)
    seen = []
    for salt in ["x", "y", "x", None]:
        before = (_encoded(recorder), _hits(recorder))
        prompt: dict[str, Any] = {"prompt_token_ids": ONE, "multi_modal_data": {"image": [A]}}
        if salt is not None:
            prompt["cache_salt"] = salt
        _assert_same(_results(llm.generate([prompt], _params(), use_tqdm=False)), [want])
        seen.append((_encoded(recorder) - before[0], _hits(recorder) - before[1]))
    assert seen == [(1, 0), (1, 0), (0, 1), (1, 0)]
    with pytest.raises(ParameterError, match="cache_salt"):
        llm.generate({"prompt_token_ids": ONE, "cache_salt": ""}, _params(), use_tqdm=False)
    _assert_idle(llm)
