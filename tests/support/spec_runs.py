"""Speculative-decoding runs of the offline engine over fixed prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.stats import StepRecorder

# Repetitive prompts: prompt lookup finds matches from the first step on.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],
    [11, 12, 13, 11, 12, 13, 11, 12],
    list(range(20, 60)) + list(range(20, 30)),
]


def generate(
    model: Path,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    **kwargs: Any,
) -> tuple[list[list[list[int]]], LLM, StepRecorder]:
    recorder = StepRecorder()
    llm = LLM(str(model), device="cpu", observer=recorder, **kwargs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outputs], llm, recorder


def copying_model(tiny: Path, out: Path) -> Path:
    """``tiny`` with its attention and MLP outputs zeroed: the next token then depends only on
    the current one, so greedy output soon cycles and prompt lookup drafts get accepted (a
    random model's drafts are nearly all rejected). Attention still runs and writes KV."""
    from safetensors.torch import load_file, save_file

    out.mkdir(exist_ok=True)
    for f in tiny.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    for f in tiny.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = t * 0.0
        save_file(tensors, out / f.name, metadata={"format": "pt"})
    return out
