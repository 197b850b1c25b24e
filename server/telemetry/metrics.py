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
idle (``engine_gauges.py``). Every series carries ``model_name``. With ``--data-parallel-size
N > 1`` the running, waiting and KV-cache gauges are one series per engine core with vLLM's
``engine`` label (``engine="0"`` .. ``"N-1"``) instead of one server-wide series; with one core
they carry no ``engine`` label (the exposition is unchanged). Counters and histograms are
server-wide.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from tokenwire.runtime.stats import RequestStats, StepStats
from tokenwire.server.telemetry.engine_gauges import (
    EngineGauges,
    EngineStateCollector,
    compat_prefixes,
)
from tokenwire.server.telemetry.processed_images_metrics import (
    CacheCounts,
    ProcessedImageCacheCollector,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds), trimmed to what a CPU or GPU server produces.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0, 20.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineMetrics:
    """The server's Prometheus registry; ``on_step`` / ``on_request_finished`` feed it."""

    def __init__(
        self,
        model_name: str,
        read_gauges: Callable[[], EngineGauges | None],
        compat: str = "both",
    ) -> None:
        self.registry = CollectorRegistry()
        self._model = model_name
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.registry.register(
            EngineStateCollector(model_name, read_gauges, compat_prefixes(compat))
        )
        # The families in exposition order: requests and tokens, latencies, speculative
        # decoding, image inputs.
        self._add_request_counters()
        self._add_latency_histograms()
        self._add_spec_decode_counters()
        self._add_image_counters()

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(f"tokenwire:{name}", doc, ["model_name", *extra], registry=self.registry)

    def _model_counter(self, name: str, doc: str) -> Counter:
        """A counter with ``model_name`` only: its one series."""
        return self._counter(name, doc).labels(self._model)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        """A histogram with ``model_name`` only: its one series."""
        family = Histogram(
            f"tokenwire:{name}", doc, ["model_name"], registry=self.registry, buckets=buckets
        )
        return family.labels(self._model)

    def _add_request_counters(self) -> None:
        """Finished requests, their tokens, tenants' refusals, preemptions, prefix-cache
        lookups."""
        # Per-request counters carry the tenant: a name from --api-key-file, "default" or
        # "anonymous" (bounded by the key file, never by what a client sends).
        self._success = self._counter(
            "request_success",
            "Finished requests by finish reason.",
            ("finish_reason", "tenant"),
        )
        self._prompt_tokens = self._counter(
            "prompt_tokens", "Prefill tokens processed.", ("tenant",)
        )
        self._generation_tokens = self._counter(
            "generation_tokens", "Tokens generated.", ("tenant",)
        )
        self._rate_limited = self._counter(
            "tenant_rate_limited_requests",
            "Requests refused by a tenant's limit (--api-key-file).",
            ("tenant", "limit"),
        )
        self.preemptions = self._model_counter("num_preemptions", "Cumulative preemptions.")
        self.prefix_queries = self._model_counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = self._model_counter(
            "prefix_cache_hits", "Prompt tokens served from the prefix cache."
        )

    def _add_latency_histograms(self) -> None:
        """TTFT, inter-token, end-to-end and queue latency; tokens per engine step."""
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds",
            "Inter-token latency (a request's mean, once per token after the first).",
            ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS
        )
        self.queue = self._histogram(
            "request_queue_time_seconds", "Time spent waiting before the first step.", E2E_BUCKETS
        )
        self.iteration_tokens = self._histogram(
            "iteration_tokens_total", "Tokens scheduled per engine step.", TOKEN_BUCKETS
        )

    def _add_spec_decode_counters(self) -> None:
        """Speculative decoding (vLLM's names)."""
        self.spec_drafts = self._model_counter(
            "spec_decode_num_drafts", "Requests verified with draft tokens, per step."
        )
        self.spec_draft_tokens = self._model_counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified."
        )
        self.spec_accepted_tokens = self._model_counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self._spec_accepted_per_pos = self._counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first).",
            ("position",),
        )

    def _add_image_counters(self) -> None:
        """Image inputs: the vision encoder and its output cache (--encoder-cache-size)."""
        self.images_encoded = self._model_counter(
            "mm_images_encoded", "Images the vision encoder ran on (distinct per step)."
        )
        self.encoder_cache_hits = self._model_counter(
            "mm_encoder_cache_hits", "Images whose features came from the encoder-output cache."
        )
        self.encoder_seconds = self._model_counter(
            "mm_encoder_seconds", "Seconds the vision encoder ran."
        )

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
    def watch_processed_images(self, read: Callable[[], CacheCounts]) -> None:
        """Export the tokenizer pool's processed-image cache hits and misses, read at scrape
        (``processed_images_metrics.py``)."""
        self.registry.register(ProcessedImageCacheCollector(self._model, read))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric in the registry."""
        return generate_latest(self.registry)
