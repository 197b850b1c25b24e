"""SMG's ``consistent_hashing`` policy (sessions routed by ``x-session-id``) completes a
multi-turn workload over gRPC workers (the vLLM engine protocol) and HTTP workers (issue 41,
item 3).

The fleet benchmark's run stopped after 41 of 64 requests just after SMG vetoed a worker as
"wedged" (no token for ``--worker-wedge-secs`` while requests pile up). Two later full-size runs
completed 64 of 64 (docs/fleet.md). Here the replicas step slowly on purpose
(``TOKENWIRE_TEST_FAULT=slow:MS``: a tiny model stepping like the default model on a loaded
box) under a tight wedge bound, sessions run concurrently and each turn extends its transcript.
Every request must complete, and the replicas must end idle with every KV block free.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from serve_process import Served, serve
from smg_gateway import MODEL, Gateway, replica_idle, start_gateway

from tokenwire.runtime.engine.fault import FAULT_ENV

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

STEP_MS = 400  # every engine step of a replica takes this much longer
WEDGE_SECS = "1"  # SMG's liveness bound (default 3 s), tighter than its default
CONVERSATIONS, TURNS, MAX_TOKENS = 8, 3, 6


@pytest.fixture(scope="module")
def replicas(tiny_model_with_tokenizer: Path) -> Iterator[list[Served]]:
    flags = ("--served-model-name", MODEL, "--worker-protocol", "vllm", "--max-model-len", "512")
    env = {FAULT_ENV: f"slow:{STEP_MS}"}
    with ThreadPoolExecutor(2) as pool:
        started = list(
            pool.map(lambda _: serve(tiny_model_with_tokenizer, *flags, env=env), range(2))
        )
    yield started
    for served in started:
        served.kill()


def _gateway(replicas: list[Served], workers: str) -> Gateway:
    urls = [f"grpc://{r.target}" if workers == "grpc" else r.rest_url for r in replicas]
    policy = ["--policy", "consistent_hashing", "--routing-key-headers", "x-session-id"]
    return start_gateway(urls, *policy, "--worker-wedge-secs", WEDGE_SECS, timeout=180)


def _conversation(url: str, index: int) -> int:
    """One session's turns, one after another; returns the number of answered turns."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    messages: list[dict[str, str]] = []
    answered = 0
    with client:
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Conversation {index}, turn {turn}."})
            reply = client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_headers={"x-session-id": f"session-{index}"},
            )
            assert reply.choices[0].finish_reason in ("length", "stop")
            content = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": content})
            answered += 1
    return answered


@pytest.mark.parametrize("workers", ["grpc", "http"])
def test_consistent_hashing_multiturn_completes_every_request(
    replicas: list[Served], workers: str
) -> None:
    gateway = _gateway(replicas, workers)
    try:
        with ThreadPoolExecutor(CONVERSATIONS) as pool:
            answered = list(pool.map(lambda i: _conversation(gateway.url, i), range(CONVERSATIONS)))
        log = gateway.output()
    finally:
        gateway.stop()
    assert answered == [TURNS] * CONVERSATIONS, log[-3000:]
    for served in replicas:
        gauges = replica_idle(served)
        assert gauges["tokenwire:num_requests_running"] == 0, gauges
        assert gauges["tokenwire:kv_cache_free_blocks"] == gauges["tokenwire:kv_cache_num_blocks"]
