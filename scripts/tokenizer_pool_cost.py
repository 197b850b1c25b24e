#!/usr/bin/env python3
"""What moving tokenization off the event loop costs per request (issue 10's figure).

Tokenizes the same chat prompts with the default model's tokenizer three ways, on one asyncio
loop: inline on the loop (what the server did before), through ``TokenizerPool`` one at a
time (the hand-off latency a request pays), and through the pool 16 at a time (concurrent
requests, the serving case). Prints per-prompt milliseconds and ends with one JSON line.

    .venv/bin/python scripts/tokenizer_pool_cost.py
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable

from tokenwire.runtime.front.frontend import Frontend
from tokenwire.runtime.front.tokenizer import apply_chat_template, load_tokenizer
from tokenwire.runtime.loader.default_model import default_gguf_path
from tokenwire.runtime.loader.gguf_convert import ensure_converted
from tokenwire.server.grpc.tokenizer_pool import TokenizerPool

SYSTEM = "You are a helpful assistant. Answer briefly and cite the facts you rely on. " * 4
QUESTIONS = [f"Question {i}: what is {i} squared, and why does it matter?" for i in range(256)]


def chats() -> list[list[dict[str, str]]]:
    return [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS
    ]


async def timed(run: Callable[[], Awaitable[None]], repeats: int = 5) -> float:
    """Best wall time of ``repeats`` runs, in ms per prompt."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        await run()
        best = min(best, time.perf_counter() - t0)
    return 1000.0 * best / len(QUESTIONS)


async def main() -> None:
    tokenizer = load_tokenizer(ensure_converted(default_gguf_path()))
    assert tokenizer is not None
    frontend = Frontend(tokenizer, vocab_size=len(tokenizer), max_model_len=8192)
    pool = TokenizerPool(frontend, max_prompt_bytes=1 << 20)
    prompts = chats()

    async def inline() -> None:
        for messages in prompts:
            apply_chat_template(tokenizer, messages)

    async def pooled_serial() -> None:
        for messages in prompts:
            await pool.render_chat("chat", messages)

    async def pooled_16() -> None:
        for i in range(0, len(prompts), 16):
            await asyncio.gather(*(pool.render_chat("chat", m) for m in prompts[i : i + 16]))

    await inline()  # warm the template cache
    figures = {
        "inline_on_loop_ms": await timed(inline),
        "pool_one_at_a_time_ms": await timed(pooled_serial),
        "pool_16_concurrent_ms": await timed(pooled_16),
    }
    tokens = statistics.mean(len(apply_chat_template(tokenizer, m)) for m in prompts[:16])
    pool.shutdown()
    print(f"chat prompts of ~{tokens:.0f} tokens, {len(prompts)} per run, best of 5 runs:")
    for name, value in figures.items():
        print(f"  {name:<24} {value:.3f} ms per prompt")
    print(json.dumps({"bench": "tokenizer_pool_cost", "prompt_tokens": tokens, **figures}))


if __name__ == "__main__":
    asyncio.run(main())
