"""The scrape-time half of ``/metrics``: gauges read from the engine when Prometheus scrapes
(running / waiting requests, KV cache usage and blocks, with LoRA enabled vLLM's
``lora_requests_info``, ``cache_config_info``, the host KV tier), so they are exact at idle, and
vLLM's ``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` from the engine's own
counters. ``--metrics-compat`` picks their prefixes (``server/telemetry/metrics.py`` says
which). With ``--data-parallel-size N > 1`` the running, waiting and KV-cache gauges are one
series per engine core with vLLM's ``engine`` label."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenwire.runtime.stats import KVOffloadStats

METRICS_COMPAT = ("tokenwire", "vllm", "both")


@dataclass(frozen=True, slots=True)
class EngineGauges:
    """What the scrape-time collector reads from the engine (plain numbers)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    max_loras: int = 0  # 0: LoRA is not enabled (no lora_requests_info series)
    running_lora_adapters: tuple[str, ...] = ()  # adapter names of running requests
    waiting_lora_adapters: tuple[str, ...] = ()
    kv_num_blocks: int = 0  # KV blocks requests can use (the null block excluded)
    kv_free_blocks: int = 0  # of those, blocks no request holds (evictable cached included)
    prefix_cache_queries: int = 0  # prompt tokens looked up (the engine's monotonic counter)
    prefix_cache_hits: int = 0
    # vLLM's cache_config_info labels (block_size, num_gpu_blocks, ...), all strings.
    cache_config: tuple[tuple[str, str], ...] = ()
    kv_offload: KVOffloadStats | None = None  # the host KV tier; None: off
    # --data-parallel-size > 1: each engine core's gauges, by rank (this record is the sum).
    ranks: tuple[EngineGauges, ...] = ()


def compat_prefixes(compat: str) -> tuple[str, ...]:
    if compat not in METRICS_COMPAT:
        raise ValueError(f"--metrics-compat must be one of {', '.join(METRICS_COMPAT)}")
    return ("tokenwire", "vllm") if compat == "both" else (compat,)


_PER_ENGINE_GAUGES: tuple[tuple[str, str, Callable[[EngineGauges], float]], ...] = (
    ("num_requests_running", "Requests in model execution batches.", lambda g: g.num_running),
    ("num_requests_waiting", "Requests waiting to be processed.", lambda g: g.num_waiting),
    ("kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.", lambda g: g.kv_cache_usage),
    ("kv_cache_num_blocks", "KV cache blocks requests can use.", lambda g: g.kv_num_blocks),
    ("kv_cache_free_blocks", "KV cache blocks no request holds.", lambda g: g.kv_free_blocks),
)


class EngineStateCollector(Collector):
    """The scrape-time families, read from the engine when Prometheus scrapes."""

    def __init__(
        self,
        model_name: str,
        read: Callable[[], EngineGauges | None],
        prefixes: tuple[str, ...] = ("tokenwire",),
    ) -> None:
        self.model_name = model_name
        self.read = read
        self.prefixes = prefixes

    def collect(self) -> Iterator[Metric]:
        state = self.read()
        if state is None:  # the engine is not loaded yet
            return
        for prefix in self.prefixes:
            yield from self._families(prefix, state)
        if state.kv_offload is not None:  # tokenwire's own names whatever --metrics-compat
            yield from self._kv_offload(state.kv_offload)
        if "vllm" in self.prefixes:
            for name, doc, value in (
                ("prefix_cache_queries", "Prompt tokens queried.", state.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens found cached.", state.prefix_cache_hits),
            ):
                counter = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
                counter.add_metric([self.model_name], float(value))
                yield counter

    def _families(self, prefix: str, state: EngineGauges) -> Iterator[Metric]:
        # Several engine cores: one series per core, labelled engine="0", "1", ... as vLLM
        # does (no unlabelled sum beside them: sum by model_name gives the server's).
        labels = ["model_name", "engine"] if state.ranks else ["model_name"]
        per_rank = [([self.model_name, str(i)], g) for i, g in enumerate(state.ranks)]
        for name, doc, read in _PER_ENGINE_GAUGES:
            family = GaugeMetricFamily(f"{prefix}:{name}", doc, labels=labels)
            for values, gauges in per_rank or [([self.model_name], state)]:
                family.add_metric(values, float(read(gauges)))
            yield family
        if state.max_loras > 0:
            yield self._lora_info(prefix, state)
        if state.cache_config:
            keys = [k for k, _ in state.cache_config]
            info = GaugeMetricFamily(
                f"{prefix}:cache_config_info", "Information of the KV cache config.", labels=keys
            )
            info.add_metric([v for _, v in state.cache_config], 1.0)
            yield info

    def _kv_offload(self, tier: KVOffloadStats) -> Iterator[Metric]:
        """The host KV tier (docs/kv-tiers.md): size gauges and cumulative counters."""
        for name, doc, value in (
            ("kv_offload_capacity_blocks", "Host KV tier size in blocks.", tier.capacity_blocks),
            ("kv_offload_used_blocks", "Host KV tier blocks holding KV.", tier.used_blocks),
            (
                "kv_offload_session_blocks",
                "Host KV tier blocks of idle Sessions.",
                tier.session_blocks,
            ),
            ("kv_offload_disk_capacity_blocks", "Disk KV tier size.", tier.disk_capacity_blocks),
            ("kv_offload_disk_used_blocks", "Disk KV tier blocks used.", tier.disk_used_blocks),
        ):
            gauge = GaugeMetricFamily(f"tokenwire:{name}", doc, labels=["model_name"])
            gauge.add_metric([self.model_name], float(value))
            yield gauge
        counters: tuple[tuple[str, str, float], ...] = (
            ("kv_offload_hit_blocks", "Blocks loaded back from the host tier.", tier.blocks_loaded),
            ("kv_offload_saved_bytes", "Bytes copied to the host tier.", tier.bytes_saved),
            ("kv_offload_loaded_bytes", "Bytes copied from the host tier.", tier.bytes_loaded),
            ("kv_offload_disk_hit_blocks", "Blocks loaded from disk.", tier.disk_blocks_loaded),
            ("kv_offload_disk_saved_bytes", "Bytes written to disk.", tier.disk_bytes_saved),
            ("kv_offload_disk_loaded_bytes", "Bytes read from disk.", tier.disk_bytes_loaded),
            (
                "kv_offload_disk_load_failures",
                "Disk records that failed their checks at load (ignored).",
                tier.disk_load_failures,
            ),
            (
                "kv_offload_load_seconds",
                "Seconds from scheduling loads to their end, summed.",
                tier.load_time,
            ),
        )
        for counter_name, counter_doc, total in counters:
            counter = CounterMetricFamily(
                f"tokenwire:{counter_name}", counter_doc, labels=["model_name"]
            )
            counter.add_metric([self.model_name], total)
            yield counter

    def _lora_info(self, prefix: str, state: EngineGauges) -> Metric:
        """vLLM's info gauge: the adapters in use as labels (sorted, comma-joined), the
        value the Unix time of the state it shows (the engine publishes it every step)."""
        family = GaugeMetricFamily(
            f"{prefix}:lora_requests_info",
            "Running stats on LoRA requests.",
            labels=["model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        family.add_metric(
            [
                self.model_name,
                str(state.max_loras),
                ",".join(sorted(set(state.waiting_lora_adapters))),
                ",".join(sorted(set(state.running_lora_adapters))),
            ],
            time.time(),
        )
        return family
