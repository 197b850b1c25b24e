"""Defects #20, end to end: greedy output of the default model does not depend on the batch.

The real engine (``LLM``, default model on CPU, prefix caching and chunked prefill on as by
default): each chat prompt alone, then the same prompts together in batches of 2..8, the same
prompt several times in one batch (prefix hits inside the step), and ``n=2``. Every copy of a
prompt must produce the tokens it produced alone.
"""

from __future__ import annotations

import pytest

from tokenwire.runtime.front.tokenizer import apply_chat_template
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams

QUESTIONS = [
    "List three uses of copper.",
    "Tell me a story about a dragon.",
    "Describe a cat.",
    "What is 12 times 7?",
    "Write a short poem about the sea.",
    "Explain why the sky is blue.",
    "How do airplanes fly?",
    "What is the capital of France?",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
BATCH_SIZES = (2, 3, 5, 8)  # each prompt of the batch next to 1, 2, 4 and 7 others

# Generous: the shared test machine's two cores run the whole default model here.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, device="cpu", max_model_len=512)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def alone(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens, run by itself."""
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_each_prompt_alongside_1_to_7_others_gives_its_tokens_alone(
    llm: LLM, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    for size in BATCH_SIZES:
        got = generate(llm, prompts[:size], GREEDY)
        for i in range(size):
            assert got[i] == alone[i], f"prompt {i} in a batch of {size} differs from alone"


def test_one_prompt_many_times_in_a_batch_and_with_n_2(
    llm: LLM, prompts: list[list[int]], alone: list[list[int]]
) -> None:
    for i in (0, 3):
        mixed = [prompts[i], prompts[5], prompts[i], prompts[6], prompts[i]]
        got = generate(llm, mixed, GREEDY)
        assert [got[0], got[2], got[4]] == [alone[i]] * 3
        assert [got[1], got[3]] == [alone[5], alone[6]]
        two = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, n=2)
        outs = llm.generate([prompts[i]], two, use_tqdm=False)[0].outputs
        assert [o.token_ids for o in outs] == [alone[i]] * 2
    llm.engine.kv_cache_manager.check_invariants(idle=True)
