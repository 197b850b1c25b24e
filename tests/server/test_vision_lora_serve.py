"""LoRA over image prompts served (#33): a tiny random LLaVA behind the gRPC server with a PEFT
adapter on its language model (``--lora-modules lm=...``). A chat with a gRPC ``ImagePart`` and
``model`` "lm" gives the offline engine's greedy tokens with that adapter and the same prompt
ids and image (which equal HF + peft ``generate()``: ``tests/runtime/test_llava_lora.py``),
other tokens than the base model, which still answers with its own tokens."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from peft_reference import write_llava_adapter
from PIL import Image
from server_harness import ServerHarness
from tiny_llava import save_tiny_llava, synthetic_image

from tokenwire.runtime.config import LoRAConfig
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

IMAGE_TOKEN = 4
NEW_TOKENS = 6
BEFORE, AFTER = "Look at this: ", " What is it?"


def _png(seed: int) -> bytes:
    out = io.BytesIO()
    synthetic_image(seed).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def harness_model(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any) -> Path:
    path = tmp_path_factory.mktemp("llava-lora-served")
    save_tiny_llava(path / "base", len(smollm_tokenizer), IMAGE_TOKEN, max_position=512)
    smollm_tokenizer.save_pretrained(path / "base")
    write_llava_adapter(path / "base", path / "lm")
    return path / "base"


@pytest.fixture(scope="module")
def harness_options(harness_model: Path) -> dict[str, Any]:
    lora = LoRAConfig(enable_lora=True, lora_modules=(("lm", str(harness_model.parent / "lm")),))
    return dict(lora=lora, max_model_len=512, max_num_batched_tokens=512, in_process=True)


def _expected_ids(tokenizer: Any) -> list[int]:
    marker = "@@IMAGE@@"
    messages = [{"role": "user", "content": BEFORE + marker + AFTER}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    head, tail = text.split(marker)

    def encode(piece: str) -> list[int]:
        return list(tokenizer(piece, add_special_tokens=False)["input_ids"])

    return [*encode(head), IMAGE_TOKEN, *encode(tail)]


def _request(png: bytes, model: str) -> generation_pb2.GenerateRequest:
    parts = [
        common_pb2.ContentPart(text=BEFORE),
        common_pb2.ContentPart(image=common_pb2.ImagePart(data=png, mime_type="image/png")),
        common_pb2.ContentPart(text=AFTER),
    ]
    return generation_pb2.GenerateRequest(
        model=model,
        chat=common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", parts=parts)]),
        sampling=common_pb2.SamplingOptions(temperature=0.0),
        stopping=common_pb2.StoppingOptions(max_tokens=NEW_TOKENS),
    )


def test_an_adapter_answers_an_image_prompt(
    gen: generation_pb2_grpc.GenerationServiceStub,
    harness_model: Path,
    smollm_tokenizer: Any,
    harness: ServerHarness,
) -> None:
    png = _png(1)
    adapter = str(harness_model.parent / "lm")
    llm = LLM(
        str(harness_model),
        device="cpu",
        max_model_len=512,
        enable_lora=True,
        lora_modules=(("lm", adapter),),
    )
    prompt: Any = {
        "prompt_token_ids": _expected_ids(smollm_tokenizer),
        "multi_modal_data": {"image": [Image.open(io.BytesIO(png)).convert("RGB")]},
    }
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    lora = llm.engine.get_lora("lm")
    want = list(
        llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
    )
    want_base = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert want != want_base
    served = gen.Generate(_request(png, "lm"), timeout=120)
    assert served.model == "lm" and list(served.choices[0].token_ids) == want
    base = gen.Generate(_request(png, ""), timeout=120)
    assert list(base.choices[0].token_ids) == want_base
    harness.assert_idle()
