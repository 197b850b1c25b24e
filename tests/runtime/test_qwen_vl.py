"""Qwen2.5-VL and Qwen2-VL (dynamic-resolution vision transformer + Qwen2 text model with M-RoPE)
in the offline engine: greedy tokens and chosen-token logprobs (1e-3) equal HF ``generate()``
(CPU, float32, with ``mm_token_type_ids``: HF's 3D positions) on a tiny random checkpoint
saved with ``save_pretrained`` and loaded by path, with synthetic images of two sizes (12 and
30 placeholder tokens); one and two images per prompt, batched with a text-only prompt, whole
and under chunked prefill that splits image runs (the runs attend causally, so a chunk may end
inside one); a prefix-cache hit on a shared image; preemption and recompute, and async
scheduling, whose decode positions are text position + the request's rope delta; TP=2; a
checkpoint with tied embeddings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checks import assert_llm_idle
from PIL import Image
from tiny_llava import synthetic_image
from tiny_qwen_vl import IMAGE_TOKEN, VISION_END, VISION_START, save_tiny_qwen_vl
from transformers import AutoImageProcessor, AutoModelForImageTextToText

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder

NEW_TOKENS = 8
BLOCK = 16
SMALL, LARGE = (24, 32), (40, 48)  # 3 x 4 and 5 x 6 merged patches: 12 and 30 tokens
RUNS = {SMALL: 12, LARGE: 30}
IMAGE = [VISION_START, IMAGE_TOKEN, VISION_END]
TEXT = [1, *range(3, 22)]  # 20 text tokens: one whole block before the image
ONE_IMAGE = [*TEXT, *IMAGE, 30, 31, 32]
TWO_IMAGES = [1, 40, 41, *IMAGE, 42, 43, *IMAGE, 44]
TEXT_ONLY = [1, 50, 51, 52, 53, 54]
Case = tuple[list[int], list[Image.Image]]
Result = tuple[list[int], list[float]]

CASES: list[Case] = [
    (ONE_IMAGE, [synthetic_image(1, LARGE)]),
    (TWO_IMAGES, [synthetic_image(2, SMALL), synthetic_image(3, LARGE)]),
    (TEXT_ONLY, []),
]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def model_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """Qwen2.5-VL (window attention in the tower) and Qwen2-VL (full attention)."""
    name = request.param
    return save_tiny_qwen_vl(tmp_path_factory.mktemp(name), qwen2_5=name == "qwen2_5_vl")


def _expand(token_ids: list[int], images: list[Image.Image]) -> list[int]:
    """HF's ``Qwen2VLProcessor`` expansion of each ``<|image_pad|>``."""
    runs = iter(RUNS[(image.height, image.width)] for image in images)
    out: list[int] = []
    for t in token_ids:
        out.extend([IMAGE_TOKEN] * next(runs) if t == IMAGE_TOKEN else [t])
    return out


def _hf(path: Path, case: Case, new_tokens: int = NEW_TOKENS, mrope: bool = True) -> Result:
    """HF's greedy tokens and their logprobs; ``mrope`` False leaves out
    ``mm_token_type_ids`` (HF then rotates with plain 1D positions)."""
    token_ids, images = case
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ``ignore_eos``: every prompt runs on
    ids = torch.tensor([_expand(token_ids, images)])
    kwargs: dict[str, Any] = {}
    if images:
        out = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
        kwargs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        if mrope:
            kwargs["mm_token_type_ids"] = (ids == IMAGE_TOKEN).int()
    with torch.inference_mode():
        gen = model.generate(
            ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True, **kwargs,
        )  # fmt: skip
    tokens = gen.sequences[0, ids.shape[1] :].tolist()
    lps = [
        float(torch.log_softmax(logits[0].float(), -1)[t])
        for logits, t in zip(gen.logits, tokens, strict=True)
    ]
    return list(tokens), lps


def _generate(llm: LLM, cases: list[Case], new_tokens: int = NEW_TOKENS) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=1, ignore_eos=True)
    prompts: list[Any] = [
        {"prompt_token_ids": t, "multi_modal_data": {"image": i}} if i else t for t, i in cases
    ]
    return llm.generate(prompts, params, use_tqdm=False)


def _result(output: Any) -> Result:
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    lps = [step[t].logprob for step, t in zip(completion.logprobs, tokens, strict=True)]
    return tokens, lps


def _assert_matches(got: Result, want: Result) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-3)


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[Result]:
    return [_hf(model_dir, case) for case in CASES]


def test_m_rope_matters(model_dir: Path, expected: list[Result]) -> None:
    """HF with 1D positions gives other logprobs: the parity below exercises M-RoPE."""
    for case, want in zip(CASES[:2], expected, strict=False):
        assert _hf(model_dir, case, mrope=False)[1] != pytest.approx(want[1], abs=1e-3)


@pytest.mark.parametrize("chunk", [None, 24], ids=["whole", "chunked"])
def test_greedy_and_logprobs_match_hf_batched_with_text(
    model_dir: Path, expected: list[Result], chunk: int | None
) -> None:
    """One image, two images of different sizes and a text-only prompt in one batch;
    ``chunk`` 24 splits both image runs across steps."""
    kwargs: dict[str, Any] = {} if chunk is None else {"max_num_batched_tokens": chunk}
    recorder = StepRecorder()
    llm = LLM(str(model_dir), device="cpu", observer=recorder, **kwargs)
    outputs = _generate(llm, CASES)
    for output, want in zip(outputs, expected, strict=True):
        _assert_matches(_result(output), want)
    assert outputs[0].prompt_token_ids == _expand(*CASES[0])
    assert len(outputs[1].prompt_token_ids) == len(TWO_IMAGES) - 2 + 12 + 30
    if chunk is not None:  # a step ended inside the 30-token run (positions [21, 51))
        assert any(21 < end < 51 for end in _chunk_ends(recorder, outputs[0].request_id))
    assert_llm_idle(llm)


def test_tied_embeddings_checkpoint_matches_hf(tmp_path: Path) -> None:
    """A Qwen2.5-VL whose top-level config ties the output projection to the embedding (the
    text config has no such field; Qwen2.5-VL-3B's shape): no ``lm_head`` weight is saved,
    and the engine's language model ties it too."""
    path = save_tiny_qwen_vl(tmp_path, tied=True)
    want = _hf(path, CASES[0])
    llm = LLM(str(path), device="cpu")
    _assert_matches(_result(_generate(llm, CASES[:1])[0]), want)
    llm.shutdown()


def _chunk_ends(recorder: StepRecorder, request_id: str) -> list[int]:
    """The prompt position each of a request's steps computed up to."""
    ends, done = [], 0
    for step in recorder.steps:
        done += step.scheduled.get(request_id, 0)
        ends.append(done)
    return ends


def test_prefix_cache_hit_on_a_shared_image(model_dir: Path, expected: list[Result]) -> None:
    """The same image hits every full block (the last ending inside the image's run, the
    rest of the prompt computed from mid-run positions); a different image of the same size
    shares only the text block before it."""
    llm = LLM(str(model_dir), device="cpu")
    first = _generate(llm, [CASES[0]])[0]
    other_case = (ONE_IMAGE, [synthetic_image(7, LARGE)])
    other = _generate(llm, [other_case])[0]
    again = _generate(llm, [CASES[0]])[0]
    _assert_matches(_result(first), expected[0])
    _assert_matches(_result(other), _hf(model_dir, other_case))
    assert other.num_cached_tokens == BLOCK
    full_blocks = len(_expand(*CASES[0])) // BLOCK * BLOCK
    assert again.num_cached_tokens == full_blocks > len(TEXT) + 1
    _assert_matches(_result(again), expected[0])
    assert_llm_idle(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_and_async_scheduling_keep_positions(
    model_dir: Path, async_scheduling: bool
) -> None:
    """Four image prompts growing past a 9-block cache: requests are preempted and
    recomputed (their outputs' positions again text position + delta), under synchronous
    and async scheduling; every one equals HF."""
    new_tokens = 24
    cases = [
        (ONE_IMAGE, [synthetic_image(11, LARGE)]),
        (TWO_IMAGES, [synthetic_image(12, SMALL), synthetic_image(13, LARGE)]),
        (ONE_IMAGE, [synthetic_image(14, SMALL)]),
        (TWO_IMAGES, [synthetic_image(15, LARGE), synthetic_image(16, SMALL)]),
    ]
    recorder = StepRecorder()
    llm = LLM(
        str(model_dir), device="cpu", num_gpu_blocks_override=9, max_model_len=128,
        async_scheduling=async_scheduling, observer=recorder,
    )  # fmt: skip
    outputs = _generate(llm, cases, new_tokens)
    for output, case in zip(outputs, cases, strict=True):
        _assert_matches(_result(output), _hf(model_dir, case, new_tokens))
    assert sum(s.num_preemptions for s in recorder.steps) > 0
    assert_llm_idle(llm)


def test_tensor_parallel_two_ranks_match_hf(model_dir: Path, expected: list[Result]) -> None:
    """TP=2 (the encoder replicated on each rank, every rank laying out the same M-RoPE
    positions): the batch of one image, two images and text equals HF, chunked inside runs."""
    with LLM(
        str(model_dir), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=24
    ) as llm:
        for output, want in zip(_generate(llm, CASES), expected, strict=True):
            _assert_matches(_result(output), want)
        assert_llm_idle(llm)
