"""LLaVA (Llama text model + CLIP vision tower) in the offline engine: greedy tokens equal HF
``generate()`` (CPU, float32) on a tiny random checkpoint saved with ``save_pretrained`` and
loaded by path, with synthetic images the test makes; one and two images per prompt, batched
with a text-only prompt, under chunked prefill that splits an image's placeholder run; two
prompts that differ only in their image never share prefix-cache blocks past the text
before the image."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checks import assert_llm_idle
from PIL import Image
from tiny_llava import IMAGE_TOKEN, PATCHES, save_tiny_llava, synthetic_image
from transformers import CLIPImageProcessor, LlavaForConditionalGeneration

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams

NEW_TOKENS = 8
BLOCK = 16
# 20 text tokens (one whole block before any image), an image, more text.
TEXT = [1, *range(3, 22)]
ONE_IMAGE = [*TEXT, IMAGE_TOKEN, 30, 31, 32]
TWO_IMAGES = [1, 40, 41, IMAGE_TOKEN, 42, 43, IMAGE_TOKEN, 44]
TEXT_ONLY = [1, 50, 51, 52, 53, 54]


_image = synthetic_image


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llava(tmp_path_factory.mktemp("llava"))


def _expand(token_ids: list[int]) -> list[int]:
    """HF's ``LlavaProcessor`` expansion: each image token becomes one per patch."""
    out: list[int] = []
    for t in token_ids:
        out.extend([t] * (PATCHES if t == IMAGE_TOKEN else 1))
    return out


def _hf_greedy(path: Path, token_ids: list[int], images: list[Image.Image]) -> list[int]:
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    kwargs: dict[str, Any] = {}
    if images:
        processor = CLIPImageProcessor.from_pretrained(path)
        kwargs["pixel_values"] = processor(images=images, return_tensors="pt")["pixel_values"]
    ids = torch.tensor([_expand(token_ids)])
    with torch.inference_mode():
        out = model.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **kwargs
        )
    return list(out[0, ids.shape[1] :].tolist())


def _prompt(token_ids: list[int], images: list[Image.Image]) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    return prompt


def _generate(llm: LLM, prompts: list[tuple[list[int], list[Image.Image]]]) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    return llm.generate([_prompt(t, i) for t, i in prompts], params, use_tqdm=False)


CASES = [(ONE_IMAGE, [_image(1)]), (TWO_IMAGES, [_image(2), _image(3, (64, 30))]), (TEXT_ONLY, [])]


@pytest.fixture(scope="module")
def expected(llava_dir: Path) -> list[list[int]]:
    return [_hf_greedy(llava_dir, t, i) for t, i in CASES]


@pytest.mark.parametrize("chunk", [None, 24], ids=["whole", "chunked"])
def test_greedy_matches_hf_batched_with_text(
    llava_dir: Path, expected: list[list[int]], chunk: int | None
) -> None:
    """One image, two images and a text-only prompt in one batch; ``chunk`` 24 splits both
    prompts' placeholder runs across steps."""
    kwargs: dict[str, Any] = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(str(llava_dir), device="cpu", **kwargs)
    outputs = _generate(llm, CASES)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert outputs[0].prompt_token_ids == _expand(ONE_IMAGE)
    assert_llm_idle(llm)


def test_prompts_differing_only_in_the_image(llava_dir: Path) -> None:
    llm = LLM(str(llava_dir), device="cpu")
    first = _generate(llm, [(ONE_IMAGE, [_image(1)])])[0]
    other = _generate(llm, [(ONE_IMAGE, [_image(7)])])[0]
    again = _generate(llm, [(ONE_IMAGE, [_image(1)])])[0]
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    assert other.outputs[0].token_ids == _hf_greedy(llava_dir, ONE_IMAGE, [_image(7)])
    # Only the text block before the image is shared; the same image hits every full block.
    assert other.num_cached_tokens == BLOCK
    full_blocks = len(_expand(ONE_IMAGE)) // BLOCK * BLOCK
    assert again.num_cached_tokens == full_blocks > BLOCK
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_llm_idle(llm)


def test_image_count_must_match_placeholders(llava_dir: Path) -> None:
    llm = LLM(str(llava_dir), device="cpu")
    with pytest.raises(ParameterError, match="multi_modal_data"):
        _generate(llm, [(ONE_IMAGE, [_image(1), _image(2)])])
    with pytest.raises(ParameterError, match="multi_modal_data"):
        _generate(llm, [(ONE_IMAGE, [])])
    assert_llm_idle(llm)
