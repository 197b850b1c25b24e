"""The embedded default model (SmolLM2-135M-Instruct GGUF) end to end: greedy parity with HF
``generate()`` on the same GGUF, "Paris", stop strings across tokens, streaming deltas."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from tiny_models import default_gguf_path
from transformers import AutoModelForCausalLM

from tokenwire.runtime.front.tokenizer import apply_chat_template
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.outputs import FinishReason
from tokenwire.runtime.sampling_params import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=30)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, device="cpu")


def test_capital_of_france_matches_hf_generate(llm: LLM) -> None:
    out = llm.chat(QUESTION, GREEDY, use_tqdm=False)[0]
    choice = out.outputs[0]
    assert "Paris" in choice.text
    assert choice.finish_reason == FinishReason.EOS
    gguf = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    prompt = apply_chat_template(llm.get_tokenizer(), QUESTION)
    assert out.prompt_token_ids == prompt
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)
    assert choice.token_ids == ref[0, len(prompt) :].tolist()
    llm.engine.kv_cache_manager.check_invariants(idle=True)


def test_stop_strings_across_token_boundaries(llm: LLM) -> None:
    full = llm.chat(QUESTION, GREEDY, use_tqdm=False)[0].outputs[0].text
    assert full.startswith("The capital of France is Paris")
    # "capital of" spans two tokens; " Par" ends inside the token " Paris".
    for stop, include, expected in [
        ("capital of", False, "The "),
        ("capital of", True, "The capital of"),
        (" Par", False, "The capital of France is"),
        ("is Paris", True, "The capital of France is Paris"),
    ]:
        params = SamplingParams(
            temperature=0.0, max_tokens=30, stop=[stop, "zzz"], include_stop_str_in_output=include
        )
        choice = llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
        assert choice.text == expected
        assert (choice.finish_reason, choice.stop_reason) == (FinishReason.STOP_SEQUENCE, stop)
    llm.engine.kv_cache_manager.check_invariants(idle=True)


def test_streamed_deltas_concatenate_to_the_final_text(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    prompt = apply_chat_template(tokenizer, [{"role": "user", "content": "Say hi in French."}])
    final = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    deltas = list(llm.stream(prompt, GREEDY))
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert deltas[-1].finish_reason == final.finish_reason
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_cli_generate_streams_the_answer() -> None:
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
    assert exe is not None
    result = subprocess.run(
        [exe, "generate", "--chat", "--max-tokens", "20", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Paris" in result.stdout
