"""``tokenwire bench serve`` with the fleet workloads (issue 28) against a real ``tokenwire
serve`` process: every turn of every conversation completes, turns of a conversation run in
order, and the prefix-cache hit rate read from the replica's /metrics is the one the
transcripts imply (each turn's prompt extends the previous turn's, so its full blocks hit)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from serve_process import Served, serve
from tiny_models import TINY_VOCAB

from tokenwire.bench.configs import ServeBenchConfig
from tokenwire.bench.fleet_workloads import FleetShape, make_fleet_workload
from tokenwire.bench.replica_metrics import parse_cache_counters
from tokenwire.bench.serve import serve_bench_summary

BLOCK = 16
SHAPE = FleetShape(
    conversations=4, turns=3, first_prompt=40, user_message=12, output_len=6, system_len=48
)


@pytest.fixture(scope="module")
def served(tiny_model_factory: Callable[..., Path]) -> Iterator[Served]:
    s = serve(tiny_model_factory("llama"), "--block-size", str(BLOCK))
    try:
        yield s
    finally:
        s.kill()


def _config(served: Served, workload: str) -> ServeBenchConfig:
    return ServeBenchConfig(
        target=served.target,
        workload=workload,
        vocab_size=TINY_VOCAB,
        concurrency=2,
        replica_metrics=(f"{served.rest_url}/metrics",),
        fleet=SHAPE,
    )


def test_multiturn_transcripts_grow_and_hit_the_prefix_cache(served: Served) -> None:
    conversations = make_fleet_workload("multiturn", TINY_VOCAB, SHAPE)
    for c in conversations:  # each prompt extends the one before
        for before, after in zip(c.turns, c.turns[1:], strict=False):
            assert after.prompt[: len(before.prompt)] == before.prompt
    summary = serve_bench_summary(_config(served, "multiturn"))
    assert summary["failed"] == 0 and summary["completed"] == SHAPE.conversations * SHAPE.turns
    assert summary["total_output_tokens"] == SHAPE.conversations * SHAPE.turns * SHAPE.output_len
    # Hits: the full blocks of the previous turn's prompt (its answer tokens are the workload's
    # own, not the model's, so nothing past them is shared).
    queries = sum(len(t.prompt) for c in conversations for t in c.turns)
    hits = sum(
        len(before.prompt) // BLOCK * BLOCK for c in conversations for before in c.turns[:-1]
    )
    assert summary["prefix_cache_hit_rate"] == pytest.approx(hits / queries, abs=0.01)
    assert summary["replica_prompt_tokens"] == [queries]


def test_shared_prefix_requests_reuse_the_system_prompts(served: Served) -> None:
    requests = make_fleet_workload("shared-prefix", TINY_VOCAB, SHAPE)
    summary = serve_bench_summary(_config(served, "shared-prefix"))
    assert summary["failed"] == 0 and summary["completed"] == len(requests)
    # Every request but the first of each system prompt hits the system prompt's full blocks
    # (requests cycle through the prompts, so two alike never start in the same step).
    queries = sum(len(c.turns[0].prompt) for c in requests)
    hits = (len(requests) - SHAPE.system_prompts) * (SHAPE.system_len // BLOCK * BLOCK)
    assert summary["prefix_cache_hit_rate"] == pytest.approx(hits / queries, abs=0.01)


def test_metrics_page_parsing_prefers_tokenwire_names() -> None:
    page = (
        "# TYPE vllm:prefix_cache_queries_total counter\n"
        'vllm:prefix_cache_queries_total{model_name="m"} 7.0\n'
        "# TYPE tokenwire:prefix_cache_queries_total counter\n"
        'tokenwire:prefix_cache_queries_total{model_name="m"} 10.0\n'
        "# TYPE tokenwire:prefix_cache_hits_total counter\n"
        'tokenwire:prefix_cache_hits_total{model_name="m"} 4.0\n'
    )
    counters = parse_cache_counters(page)
    assert (counters.queries, counters.hits) == (10.0, 4.0)
    with pytest.raises(ValueError, match="prefix_cache_queries_total"):
        parse_cache_counters("# nothing here\n")
