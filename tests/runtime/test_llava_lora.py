"""LoRA on a vision-language model's language model (#33): a PEFT adapter made here on HF's
``LlavaForConditionalGeneration`` (its keys ``base_model.model.model.language_model.layers.*``)
loads into the offline engine and, with an image prompt batched beside a text-only one, gives
HF + peft ``generate()``'s greedy tokens (CPU, float32) with the same image; the base model in
the same engine still gives HF's base tokens. An adapter whose tensors reach the vision tower
(PEFT's plain ``target_modules`` names match CLIP's projections too) is refused naming the
tensor and the rule: LoRA applies to the language model only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checks import assert_llm_idle
from peft_reference import write_llava_adapter
from PIL import Image
from tiny_llava import IMAGE_TOKEN, PATCHES, save_tiny_llava, synthetic_image
from transformers import CLIPImageProcessor, LlavaForConditionalGeneration

from tokenwire.runtime.errors import AdapterError
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.lora.checks import read_adapter
from tokenwire.runtime.sampling_params import SamplingParams

NEW_TOKENS = 8
PROMPT = [1, 5, 6, 7, IMAGE_TOKEN, 30, 31, 32]
TEXT_ONLY = [1, 50, 51, 52, 53, 54]


def _hf_greedy(base: Path, adapter: Path | None, ids: list[int], image: Image.Image | None) -> Any:
    from peft import PeftModel

    model: Any = LlavaForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    kwargs: dict[str, Any] = {}
    if image is not None:
        processor = CLIPImageProcessor.from_pretrained(base)
        kwargs["pixel_values"] = processor(images=[image], return_tensors="pt")["pixel_values"]
    expanded = [x for t in ids for x in ([t] * (PATCHES if t == IMAGE_TOKEN else 1))]
    tensor = torch.tensor([expanded])
    with torch.inference_mode():
        out = model.generate(
            tensor, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **kwargs
        )
    return list(out[0, tensor.shape[1] :].tolist())


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("llava-lora")
    base = save_tiny_llava(d / "base")
    return {
        "base": base,
        "lm": write_llava_adapter(base, d / "lm"),
        "vision": write_llava_adapter(base, d / "vision", ["q_proj", "v_proj"]),
    }


def test_language_model_lora_with_an_image_matches_hf_peft(setup: dict[str, Path]) -> None:
    base, adapter = setup["base"], setup["lm"]
    image = synthetic_image(1)
    want = _hf_greedy(base, adapter, PROMPT, image)
    want_base = _hf_greedy(base, None, PROMPT, image)
    want_text = _hf_greedy(base, adapter, TEXT_ONLY, None)
    assert want != want_base  # the adapter changes the answer
    llm = LLM(str(base), device="cpu", enable_lora=True, lora_modules=(("lm", str(adapter)),))
    lora = llm.engine.get_lora("lm")
    prompts: list[Any] = [
        {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": [image]}},
        {"prompt_token_ids": TEXT_ONLY},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    got = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    assert [list(o.outputs[0].token_ids) for o in got] == [want, want_text]
    plain = llm.generate(prompts[:1], params, use_tqdm=False)
    assert list(plain[0].outputs[0].token_ids) == want_base
    assert_llm_idle(llm)


def test_an_adapter_on_the_vision_tower_is_refused(setup: dict[str, Path]) -> None:
    with pytest.raises(AdapterError) as err:
        read_adapter(str(setup["vision"]), max_rank=16)
    message = str(err.value)
    assert "vision_tower" in message and "language model only" in message
    with pytest.raises(ValueError, match=r"--lora-modules vision=.*language model only"):
        LLM(
            str(setup["base"]),
            device="cpu",
            enable_lora=True,
            lora_modules=(("vision", str(setup["vision"])),),
        )
