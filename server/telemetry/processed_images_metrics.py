"""The front's processed-image cache (``--mm-processor-cache-bytes``) as scrape-time
counters: ``tokenwire:mm_processor_cache_hits_total`` (images a chat render took from the
cache, neither decoded nor processed) and ``tokenwire:mm_processor_cache_misses_total``
(images looked up and not found: decoded and processed). Read from the tokenizer pool's
cache when Prometheus scrapes, so the render threads pay nothing for them; absent with the
cache off (0), which looks nothing up."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


class CacheCounts(Protocol):
    """What the collector reads of the cache's stats (``CacheStats`` has these)."""

    @property
    def hits(self) -> int: ...

    @property
    def misses(self) -> int: ...


class ProcessedImageCacheCollector(Collector):
    def __init__(self, model_name: str, read: Callable[[], CacheCounts]) -> None:
        self.model_name = model_name
        self.read = read

    def collect(self) -> Iterator[Metric]:
        counts = self.read()
        for name, doc, value in (
            (
                "mm_processor_cache_hits",
                "Images a chat render took from the processed-image cache.",
                counts.hits,
            ),
            (
                "mm_processor_cache_misses",
                "Images looked up in the processed-image cache and processed.",
                counts.misses,
            ),
        ):
            counter = CounterMetricFamily(f"tokenwire:{name}", doc, labels=["model_name"])
            counter.add_metric([self.model_name], float(value))
            yield counter
