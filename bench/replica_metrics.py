"""Prefix-cache hit rate read from every replica's Prometheus endpoint (``--replica-metrics``):
the counters before and after a run, so the figure is the run's own, whatever the gateway did
with the requests. Reads ``tokenwire:prefix_cache_{queries,hits}_total`` (prompt tokens looked
up / served from the cache), else vLLM's ``vllm:`` names, so it measures vLLM replicas too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("tokenwire:", "vllm:")


@dataclass(frozen=True)
class CacheCounters:
    queries: float
    hits: float


def parse_cache_counters(text: str) -> CacheCounters:
    """The prefix-cache counters in one /metrics page (tokenwire's names first)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for prefix in PREFIXES:
                for kind in ("queries", "hits"):
                    if sample.name == f"{prefix}prefix_cache_{kind}_total":
                        found.setdefault(f"{prefix}{kind}", 0.0)
                        found[f"{prefix}{kind}"] += sample.value
    for prefix in PREFIXES:
        if f"{prefix}queries" in found:
            return CacheCounters(found[f"{prefix}queries"], found.get(f"{prefix}hits", 0.0))
    raise ValueError("no prefix_cache_queries_total counter in the metrics page")


async def read_counters(urls: Sequence[str], api_key: str | None) -> list[CacheCounters]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=10.0, headers=headers) as client:
        pages = [await client.get(url) for url in urls]
    out = []
    for url, page in zip(urls, pages, strict=True):
        if page.status_code != 200:
            raise ValueError(f"--replica-metrics {url}: HTTP {page.status_code}")
        out.append(parse_cache_counters(page.text))
    return out


def hit_summary(before: list[CacheCounters], after: list[CacheCounters]) -> dict[str, object]:
    """Hit rate over all replicas, and how the looked-up tokens spread over them."""
    queries = [a.queries - b.queries for a, b in zip(after, before, strict=True)]
    hits = [a.hits - b.hits for a, b in zip(after, before, strict=True)]
    total = sum(queries)
    return {
        "prefix_cache_hit_rate": sum(hits) / total if total else 0.0,
        "replica_prompt_tokens": [int(q) for q in queries],
        "replica_hit_rates": [h / q if q else 0.0 for h, q in zip(hits, queries, strict=True)],
    }
