"""Gemma 3 multimodal (SigLIP tower + Gemma 3 projector + Gemma 3 text model) in the offline
engine: greedy tokens and chosen-token logprobs (1e-3) equal HF ``generate()`` (CPU, float32,
with ``token_type_ids``: HF's bidirectional attention within each image during prefill) on a
tiny random checkpoint saved with ``save_pretrained`` and loaded by path, with synthetic
images the test makes; one and two images per prompt, batched with a text-only prompt, whole
and under chunked prefill (which never splits an image's run); two prompts that differ only
in their image share no prefix-cache block past the text before the image, and a repeated
image hits every full block (one ending inside the image's run); a repeated image is encoded
once."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checks import assert_llm_idle
from PIL import Image
from tiny_gemma3_mm import BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN, IMAGE_TOKENS, save_tiny_gemma3_mm
from tiny_llava import synthetic_image
from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.front.images import ImagePrompter, ImageTokens
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder

NEW_TOKENS = 8
BLOCK = 16
TEXT = [1, *range(3, 22)]  # 20 text tokens: one whole block before the image
ONE_IMAGE = [*TEXT, BOI_TOKEN, 30, 31, 32]
TWO_IMAGES = [1, 40, 41, BOI_TOKEN, 42, 43, BOI_TOKEN, 44]
TEXT_ONLY = [1, 50, 51, 52, 53, 54]
Case = tuple[list[int], list[Image.Image]]
Result = tuple[list[int], list[float]]

CASES: list[Case] = [
    (ONE_IMAGE, [synthetic_image(1)]),
    (TWO_IMAGES, [synthetic_image(2), synthetic_image(3, (64, 30))]),
    (TEXT_ONLY, []),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_gemma3_mm(tmp_path_factory.mktemp("gemma3_mm"))


def _expand(token_ids: list[int]) -> list[int]:
    """HF's ``Gemma3Processor`` expansion of ``<start_of_image>`` (without its "\\n\\n")."""
    out: list[int] = []
    for t in token_ids:
        out.extend([BOI_TOKEN, *[IMAGE_TOKEN] * IMAGE_TOKENS, EOI_TOKEN] if t == BOI_TOKEN else [t])
    return out


def _hf(path: Path, case: Case, bidirectional: bool = True) -> Result:
    """HF's greedy tokens and their logprobs; ``bidirectional`` False leaves out
    ``token_type_ids`` (plain causal attention over the images)."""
    token_ids, images = case
    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([_expand(token_ids)])
    kwargs: dict[str, Any] = {}
    if images:
        processor = AutoImageProcessor.from_pretrained(path)
        kwargs["pixel_values"] = torch.from_numpy(
            processor(images=images, return_tensors="np")["pixel_values"]
        )
        if bidirectional:
            kwargs["token_type_ids"] = (ids == IMAGE_TOKEN).long()
    with torch.inference_mode():
        out = model.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True, **kwargs,
        )  # fmt: skip
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    lps = [
        float(torch.log_softmax(logits[0].float(), -1)[t])
        for logits, t in zip(out.logits, tokens, strict=True)
    ]
    return list(tokens), lps


def _generate(llm: LLM, cases: list[Case]) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=1)
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


def test_the_image_mask_matters(model_dir: Path, expected: list[Result]) -> None:
    """HF without ``token_type_ids`` (causal over the image) gives other logprobs: the
    parity below exercises the bidirectional mask."""
    causal = _hf(model_dir, CASES[0], bidirectional=False)
    assert causal[1] != pytest.approx(expected[0][1], abs=1e-3)


@pytest.mark.parametrize("chunk", [None, 24], ids=["whole", "chunked"])
def test_greedy_and_logprobs_match_hf_batched_with_text(
    model_dir: Path, expected: list[Result], chunk: int | None
) -> None:
    """One image, two images and a text-only prompt in one batch; ``chunk`` 24 would split
    each image's run (16 tokens after 20 tokens of text), so the scheduler cuts before it."""
    kwargs: dict[str, Any] = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(str(model_dir), device="cpu", **kwargs)
    outputs = _generate(llm, CASES)
    for output, want in zip(outputs, expected, strict=True):
        _assert_matches(_result(output), want)
    assert outputs[0].prompt_token_ids == _expand(ONE_IMAGE)
    assert_llm_idle(llm)


def test_prompts_differing_only_in_the_image(model_dir: Path, expected: list[Result]) -> None:
    llm = LLM(str(model_dir), device="cpu")
    first = _generate(llm, [CASES[0]])[0]
    other_case = (ONE_IMAGE, [synthetic_image(7)])
    other = _generate(llm, [other_case])[0]
    again = _generate(llm, [CASES[0]])[0]
    _assert_matches(_result(first), expected[0])
    _assert_matches(_result(other), _hf(model_dir, other_case))
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    # Only the text block before the image is shared; the same image hits every full block,
    # the last one ending inside the image's run (its rest recomputed whole).
    assert other.num_cached_tokens == BLOCK
    full_blocks = len(_expand(ONE_IMAGE)) // BLOCK * BLOCK
    assert again.num_cached_tokens == full_blocks > len(TEXT) + 1
    _assert_matches(_result(again), expected[0])
    assert_llm_idle(llm)


def test_a_repeated_image_is_encoded_once(model_dir: Path, expected: list[Result]) -> None:
    """The encoder-output cache serves Gemma 3 too: the same image in a later request and
    twice in one prompt is encoded once (prefix caching off, so every request reaches the
    encoder), with HF's tokens and logprobs; chunked so the runs land in separate steps."""
    recorder = StepRecorder()
    llm = LLM(
        str(model_dir), device="cpu", enable_prefix_caching=False,
        max_num_batched_tokens=24, observer=recorder,
    )  # fmt: skip
    same = (TWO_IMAGES, [synthetic_image(1), synthetic_image(1)])
    for case, want in [(CASES[0], expected[0]), (same, _hf(model_dir, same))]:
        _assert_matches(_result(_generate(llm, [case])[0]), want)
    assert sum(s.num_images_encoded for s in recorder.steps) == 1
    assert sum(s.num_encoder_cache_hits for s in recorder.steps) == 2
    assert_llm_idle(llm)


def test_a_step_must_hold_an_image_run(model_dir: Path) -> None:
    """A run is computed whole in one step: a step budget below it is a startup error naming
    the flag, not a request that never runs."""
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        LLM(str(model_dir), device="cpu", max_num_batched_tokens=IMAGE_TOKENS - 1)


def test_pan_and_scan_crops_are_refused(model_dir: Path) -> None:
    """A processor that crops one image into several (Gemma 3's pan-and-scan) would feed
    one image's pixels to another's run: refused, naming the field."""
    processor = AutoImageProcessor.from_pretrained(model_dir)
    tokens = ImageTokens.of_config(_config(model_dir))
    assert tokens is not None and tokens.bidirectional
    prompter = ImagePrompter(tokens, processor)
    wide = synthetic_image(1, (32, 256))
    assert prompter.expand(ONE_IMAGE, [wide])[1][0].length == IMAGE_TOKENS
    crops = dataclasses.replace(
        prompter, processor=AutoImageProcessor.from_pretrained(
            model_dir, do_pan_and_scan=True, pan_and_scan_min_crop_size=8,
            pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2,
        )
    )  # fmt: skip
    with pytest.raises(ParameterError, match="pan-and-scan"):
        crops.expand(ONE_IMAGE, [wide])


def _config(path: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    return config
