"""The CPU fast path keeps its memory flat (issue 42): the default model kept quantized (int4
linears on torch's bf16 kernel, bf16 LM head), one greedy stream of 1,000 decode steps after a
200-step warm-up. The KV cache is allocated at startup and every step's buffers are reused, so
the process's resident set may not grow with the number of steps (the attention's per-step
gathers grow with the context, by well under a MiB over these lengths)."""

from __future__ import annotations

import psutil
import pytest

from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS, WARM_UP = 1000, 200
# Allocator noise (a few arenas, Python objects of one request's outputs: 1,000 token ids and
# their logprob-less outputs) stays far below this; a per-step leak of even 32 KiB exceeds it.
ALLOWED_GROWTH = 24 << 20


def test_rss_is_flat_over_1000_decode_steps() -> None:
    llm = LLM(None, device="cpu", max_model_len=STEPS + 64, num_gpu_blocks_override=128)
    assert llm.engine.facts.quantization == "gguf"  # the fast path, not float32
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]

    def run(steps: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        return out.outputs[0].token_ids

    warm = run(WARM_UP)
    process = psutil.Process()
    before = process.memory_info().rss
    tokens = run(STEPS)
    after = process.memory_info().rss
    assert len(tokens) == STEPS and tokens[:WARM_UP] == warm  # same work, same tokens
    assert after - before < ALLOWED_GROWTH, f"RSS grew {(after - before) >> 20} MiB"
