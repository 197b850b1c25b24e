"""PEFT LoRA adapters for the runtime tests, written with the ``peft`` library on a tiny base
model, and the HF transformers + peft greedy reference."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    targets: Sequence[str] = ALL_TARGETS,
    seed: int = 0,
    rslora: bool = False,
    scale: float = 0.3,
) -> Path:
    """Save a PEFT adapter of ``base_dir`` with random A and B (normal, std ``scale``), so
    its outputs differ from the base model's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(out_dir)
    return out_dir


LLAVA_LM_TARGETS = r".*language_model.*\.(q_proj|v_proj|o_proj|down_proj)"


def write_llava_adapter(base_dir: Path, out_dir: Path, targets: object = LLAVA_LM_TARGETS) -> Path:
    """A PEFT adapter of HF's ``LlavaForConditionalGeneration`` (random A and B, std 0.3):
    by default on the language model's projections only (a regex; PEFT's plain names would
    reach CLIP's projections too)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


def hf_lora_greedy(
    base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy tokens of transformers (+ peft with ``adapter_dir``), one prompt at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(ids[0, len(prompt) :].tolist())
    return out
