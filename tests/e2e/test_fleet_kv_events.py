"""SMG's cache_aware policy reads tokenwire's KV events (issue 41, item 5): two replicas behind
the real SMG over gRPC workers, one started with ``--kv-events-config`` (in-process hub only)
and one without. SMG subscribes to each worker's ``SubscribeKvEvents`` stream: it applies the
first replica's live batches to its index (a prompt sent to that replica directly, past the
gateway, is known to SMG only through them) and routes the same prefix there, and it marks the
second replica's cache as unavailable (that replica answers UNIMPLEMENTED naming the flag).
docs/fleet.md and the Helm chart pair the events with cache_aware."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_process import Served, serve
from smg_gateway import MODEL, Gateway, replica_idle, start_gateway

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

EVENTS_ON = json.dumps({"enable_kv_cache_events": True, "publisher": "null"})
PREFIX = "You are a terse assistant that answers with one word. " * 6


@pytest.fixture(scope="module")
def replicas(tiny_model_with_tokenizer: Path) -> Iterator[list[Served]]:
    flags = ("--served-model-name", MODEL, "--worker-protocol", "vllm", "--max-model-len", "512")
    extra = [("--kv-events-config", EVENTS_ON), ()]
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda e: serve(tiny_model_with_tokenizer, *flags, *e), extra))
    yield started
    for served in started:
        served.kill()


@pytest.fixture(scope="module")
def gateway(replicas: list[Served]) -> Iterator[Gateway]:
    gw = start_gateway([f"grpc://{r.target}" for r in replicas], "--policy", "cache_aware")
    yield gw
    gw.stop()


def _kv_samples(gateway: Gateway) -> list[tuple[str, dict[str, str], float]]:
    text = httpx.get(gateway.metrics_url, timeout=10).text
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(("smg_kv_event", "smg_kv_events"))
    ]


def _of(
    samples: list[tuple[str, dict[str, str], float]], name: str, replica: Served, **match: str
) -> float:
    """The sum of ``name``'s samples for ``replica``'s worker (and the ``match`` labels)."""
    worker = f"grpc://{replica.target}"
    return sum(
        v
        for n, labels, v in samples
        if n == name and labels.get("worker") == worker and match.items() <= labels.items()
    )


def _finished(served: Served) -> float:
    text = httpx.get(f"{served.rest_url}/metrics", timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tokenwire:request_success_total"
    )


def _complete(url: str, prompt: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    with client:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert reply.choices[0].text is not None


def test_cache_aware_routes_by_the_events_of_the_replica_that_publishes_them(
    gateway: Gateway, replicas: list[Served]
) -> None:
    on, off = replicas
    _complete(on.rest_url, PREFIX)  # straight to the replica: only its events tell SMG
    deadline = time.monotonic() + 60
    while True:  # SMG applies batches as its stream delivers them: a bounded outside poll
        samples = _kv_samples(gateway)
        applied = _of(samples, "smg_kv_event_batches_total", on, disposition="applied")
        if (applied > 0 and _of(samples, "smg_kv_events_unavailable", off) == 1) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    assert applied > 0, samples
    assert _of(samples, "smg_kv_events_unavailable", on) == 0, samples
    assert _of(samples, "smg_kv_events_unavailable", off) == 1, samples
    before = [_finished(r) for r in replicas]
    for i in range(4):
        _complete(gateway.url, f"{PREFIX} Question {i}:")
    after = [_finished(r) for r in replicas]
    # SMG learned the prefix only from the events: every request goes where it is cached.
    assert after[0] - before[0] == 4 and after[1] == before[1], (before, after)
    for served in replicas:
        gauges = replica_idle(served)
        assert gauges["tokenwire:num_requests_running"] == 0
        assert gauges["tokenwire:kv_cache_free_blocks"] == gauges["tokenwire:kv_cache_num_blocks"]
