"""Benchmark workloads (``--workload``), generated deterministically from Python's ``random``."""

from __future__ import annotations

import random
from dataclasses import dataclass

from tokenwire.bench.edit_texts import edit_messages
from tokenwire.runtime.front.tokenizer import Tokenizer, apply_chat_template

WORKLOADS = ("fixed", "mixed", "cpu", "repeat", "edit", "short")
# ``repeat``: answers that copy from their prompts (what prompt-lookup speculation is for):
# a random passage given twice, then its first tokens again; a model continues the copy.
REPEAT_PASSAGE = 96
REPEAT_CUE = 8
REPEAT_OUTPUT = 64
# ``edit``: chat requests to repeat or lightly rewrite a passage of prose or code
# (``edit_texts``), rendered with the model's chat template; the answer copies the passage.
EDIT_OUTPUT = 64
# ``short``: 64 requests of 128 random prompt tokens and 64 output tokens each.
SHORT_PROMPT, SHORT_OUTPUT = 128, 64


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    name: str,
    vocab_size: int,
    num_requests: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> Workload:
    """Build a workload; token ids are clipped into the model's vocabulary. ``edit`` needs the
    model's ``tokenizer`` (its prompts are text).

    ``mixed`` reproduces nano-vllm's benchmark exactly (prompt tokens sum to 142,827 and
    output tokens to 133,966 for the default 256 requests). ``repeat`` (16 requests): a random
    96-token passage twice, then its first 8 tokens; 64 output tokens. ``edit`` (16
    requests): chat prompts asking to repeat or lightly rewrite a passage; 64 output tokens.
    ``short`` (64 requests): 128 prompt tokens, 64 output tokens (the llama.cpp comparison).
    """
    rng = random.Random(0)
    max_id = min(10000, vocab_size - 1)
    if name == "mixed":
        n = num_requests or 256
        prompts = [
            [rng.randint(0, max_id) for _ in range(rng.randint(100, 1024))] for _ in range(n)
        ]
        output_lens = [rng.randint(100, 1024) for _ in range(n)]
    elif name == "fixed":
        n = num_requests or 256
        prompts = [[rng.randint(0, max_id) for _ in range(512)] for _ in range(n)]
        output_lens = [128] * n
    elif name == "repeat":
        n = num_requests or 16
        low = min(1000, max_id // 2)
        passages = [[rng.randint(low, max_id) for _ in range(REPEAT_PASSAGE)] for _ in range(n)]
        prompts = [p + p + p[:REPEAT_CUE] for p in passages]
        output_lens = [REPEAT_OUTPUT] * n
    elif name == "edit":
        if tokenizer is None:
            raise ValueError("workload 'edit' needs the model's tokenizer (its prompts are text)")
        n = num_requests or 16
        prompts = [apply_chat_template(tokenizer, edit_messages(i)) for i in range(n)]
        output_lens = [EDIT_OUTPUT] * n
    elif name == "short":  # the llama.cpp comparison's shape (issue 42)
        n = num_requests or 64
        prompts = [[rng.randint(0, max_id) for _ in range(SHORT_PROMPT)] for _ in range(n)]
        output_lens = [SHORT_OUTPUT] * n
    elif name == "cpu":
        n = num_requests or 64
        prompts = [[rng.randint(0, max_id) for _ in range(rng.randint(32, 256))] for _ in range(n)]
        output_lens = [rng.randint(32, 128) for _ in range(n)]
    else:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    return Workload(name, prompts, output_lens)


def bench_tokenizer(path: str | None) -> Tokenizer:
    """The tokenizer of a model folder / hub id (``--tokenizer``), else the default model's,
    for workloads whose prompts are text."""
    from tokenwire.runtime.config import ModelConfig
    from tokenwire.runtime.front.tokenizer import load_tokenizer
    from tokenwire.runtime.loader.source import model_source

    folder = model_source(ModelConfig(model=path)).folder
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        raise ValueError(f"--tokenizer: no tokenizer in {folder}")
    return tokenizer
