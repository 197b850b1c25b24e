"""Prometheus metrics with vLLM's names (``tokenwire:*``), in a registry the server owns.

``--metrics-compat`` picks the prefix of what an endpoint picker reads: ``tokenwire`` (only
``tokenwire:*``), ``vllm`` (those series as ``vllm:*``, which llm-d / the Gateway API
Inference Extension read unchanged) or ``both`` (the default: existing dashboards keep
working and pickers need no mapping; the cost is a handful of extra series). The ``vllm:``
set is what pickers read: the gauges, ``lora_requests_info``, ``cache_config_info`` and
``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (counted per scheduled prompt
lookup, from the engine's own counters, as vLLM counts them).

Counters and histograms are fed from the engine's plain records (``StepStats`` per step,
``RequestStats`` per finished request) on the engine thread — a handful of locked adds per
step. Gauges (running / waiting requests, KV cache usage, and with LoRA enabled vLLM's
``lora_requests_info``) are read from the engine when Prometheus scrapes, so they are exact at
idle. Every series carries ``model_name``. With ``--data-parallel-size N > 1`` the running,
waiting and KV-cache gauges are one series per engine core with vLLM's ``engine`` label
(``engine="0"`` .. ``"N-1"``) instead of one server-wide series; with one core they carry no
``engine`` label (the exposition is unchanged). Counters and histograms are server-wide.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenwire.runtime.stats import KVOffloadStats, RequestStats, StepStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
METRICS_COMPAT = ("tokenwire", "vllm", "both")

# vLLM's buckets (seconds), trimmed to what a CPU or GPU server produces.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0, 20.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


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


class _EngineStateCollector(Collector):
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


class EngineMetrics:
    """The server's Prometheus registry; ``on_step`` / ``on_request_finished`` feed it."""

    def __init__(
        self,
        model_name: str,
        read_gauges: Callable[[], EngineGauges | None],
        compat: str = "both",
    ) -> None:
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        reg.register(_EngineStateCollector(model_name, read_gauges, compat_prefixes(compat)))

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"tokenwire:{name}", doc, [*labels, *extra], registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tokenwire:{name}", doc, labels, registry=reg, buckets=buckets)

        # Per-request counters carry the tenant: a name from --api-key-file, "default" or
        # "anonymous" (bounded by the key file, never by what a client sends).
        self._success = counter(
            "request_success",
            "Finished requests by finish reason.",
            ("finish_reason", "tenant"),
        )
        self._model = model_name
        m = model_name
        self._prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.", ("tenant",))
        self._generation_tokens = counter("generation_tokens", "Tokens generated.", ("tenant",))
        self._rate_limited = counter(
            "tenant_rate_limited_requests",
            "Requests refused by a tenant's limit (--api-key-file).",
            ("tenant", "limit"),
        )
        self.preemptions = counter("num_preemptions", "Cumulative preemptions.").labels(m)
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(m)
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prompt tokens served from the prefix cache."
        ).labels(m)
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        ).labels(m)
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Inter-token latency (a request's mean, once per token after the first).",
            ITL_BUCKETS,
        ).labels(m)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS
        ).labels(m)
        self.queue = histogram(
            "request_queue_time_seconds", "Time spent waiting before the first step.", E2E_BUCKETS
        ).labels(m)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens scheduled per engine step.", TOKEN_BUCKETS
        ).labels(m)
        # Speculative decoding (vLLM's names).
        self.spec_drafts = counter(
            "spec_decode_num_drafts", "Requests verified with draft tokens, per step."
        ).labels(m)
        self.spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified."
        ).labels(m)
        self.spec_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        ).labels(m)
        self._spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first).",
            ("position",),
        )
        # Image inputs: the vision encoder and its output cache (--encoder-cache-size).
        self.images_encoded = counter(
            "mm_images_encoded", "Images the vision encoder ran on (distinct per step)."
        ).labels(m)
        self.encoder_cache_hits = counter(
            "mm_encoder_cache_hits", "Images whose features came from the encoder-output cache."
        ).labels(m)
        self.encoder_seconds = counter(
            "mm_encoder_seconds", "Seconds the vision encoder ran."
        ).labels(m)

    # ------------------------------------------------------------------ engine thread
    def on_step(self, stats: StepStats) -> None:
        self.iteration_tokens.observe(stats.num_prefill_tokens + stats.num_decode_tokens)
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        if stats.num_drafts:
            self.spec_drafts.inc(stats.num_drafts)
            self.spec_draft_tokens.inc(stats.num_draft_tokens)
            self.spec_accepted_tokens.inc(stats.num_accepted_tokens)
            for position, count in enumerate(stats.accepted_per_pos):
                self._spec_accepted_per_pos.labels(self._model, str(position)).inc(count)
        if stats.num_images_encoded or stats.num_encoder_cache_hits:
            self.images_encoded.inc(stats.num_images_encoded)
            self.encoder_cache_hits.inc(stats.num_encoder_cache_hits)
            self.encoder_seconds.inc(stats.encoder_time)

    def on_request_finished(
        self, stats: RequestStats, tenant: str = "default", finish_reason: str | None = None
    ) -> None:
        """``finish_reason``: what the client saw when it was not the engine's reason (a
        call that failed after the engine finished: "error"; None: ``stats``' own)."""
        reason = finish_reason or stats.finish_reason.value
        self._success.labels(self._model, reason, tenant).inc()
        self._prompt_tokens.labels(self._model, tenant).inc(stats.num_prompt_tokens)
        self._generation_tokens.labels(self._model, tenant).inc(stats.num_output_tokens)
        self.prefix_queries.inc(stats.num_prompt_tokens)
        self.prefix_hits.inc(stats.num_cached_tokens)
        self.e2e.observe(stats.finished_time - stats.arrival_time)
        if stats.first_scheduled_time is not None:
            self.queue.observe(stats.first_scheduled_time - stats.arrival_time)
        if stats.first_token_time is not None:
            self.ttft.observe(stats.first_token_time - stats.arrival_time)
            if stats.num_output_tokens > 1:
                mean = (stats.finished_time - stats.first_token_time) / (
                    stats.num_output_tokens - 1
                )
                for _ in range(stats.num_output_tokens - 1):
                    self.itl.observe(mean)

    def request_failed(self, tenant: str, finish_reason: str) -> None:
        """A request that ended without an engine record (an engine fault)."""
        self._success.labels(self._model, finish_reason, tenant).inc()

    def rate_limited(self, tenant: str, limit: str) -> None:
        """A tenant's limit refused a request (event loop)."""
        self._rate_limited.labels(self._model, tenant, limit).inc()

    # ------------------------------------------------------------------ scrape
    def exposition(self) -> bytes:
        """The Prometheus text format of every metric in the registry."""
        return generate_latest(self.registry)
