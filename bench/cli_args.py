"""The flags of ``tokenwire bench``'s sub-commands: one ``add_*_arguments`` per command, each
default read from the (torch-free) configs in ``bench/configs.py``. ``bench/cli.py`` adds the
sub-commands and turns their parsed flags into configs."""

from __future__ import annotations

import argparse

from tokenwire.bench.configs import (
    DEFAULT_WORKLOAD,
    EmbedBenchConfig,
    HfBaselineConfig,
    LoRABenchConfig,
    OverheadConfig,
    ServeBenchConfig,
    ThroughputConfig,
)
from tokenwire.bench.roofline import DEVICES
from tokenwire.bench.workloads import WORKLOADS
from tokenwire.runtime.engine_args import EngineArgs
from tokenwire.runtime.loader.bundled_configs import BUNDLED_CONFIGS


def add_workload_arguments(p: argparse.ArgumentParser, fleet: bool = False) -> None:
    from tokenwire.bench.fleet_workloads import FLEET_WORKLOADS

    p.add_argument(
        "--workload",
        choices=(*WORKLOADS, *FLEET_WORKLOADS) if fleet else WORKLOADS,
        default=DEFAULT_WORKLOAD,
        help="request mix (bench/workloads.py): fixed, mixed (nano-vllm's), cpu (64 short), "
        "repeat (answers copy their prompts), edit (chat rewrites of a passage)"
        + (
            "; fleet (bench/fleet_workloads.py): multiturn (growing transcripts), "
            "shared-prefix (a few long system prompts)"
            if fleet
            else ""
        )
        + " (default: %(default)s)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests to run (default: the workload's own count)",
    )


def add_throughput_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    p.add_argument(
        "--compare",
        choices=["none", "hf"],
        default=ThroughputConfig.compare,
        help="also run HF transformers on the same workload (one at a time and in static "
        "batches) and report the speed-ups (default: %(default)s)",
    )
    p.add_argument(
        "--hf-sequential-requests",
        type=int,
        default=HfBaselineConfig.sequential_requests,
        help="HF one-at-a-time runs only this many requests (it is slow; 0 skips it)",
    )
    p.add_argument(
        "--hf-batch-sizes",
        default=",".join(map(str, HfBaselineConfig.batch_sizes)),
        help="comma-separated static batches",
    )
    p.add_argument(
        "--hf-num-requests",
        type=int,
        default=None,
        help="HF static batches run only the first N requests (default: all)",
    )
    p.add_argument(
        "--floor-device",
        choices=[d.name for d in DEVICES],
        default=None,
        help="roofline ceilings to report the floor against (default: the CUDA device's; "
        "'unknown' on the CPU or a device not in the table)",
    )
    p.add_argument(
        "--tpot",
        type=int,
        default=ThroughputConfig.tpot,
        help="also measure batch-1 TPOT over this many tokens",
    )
    EngineArgs.add_cli_args(
        p,
        model_help="model path, or with --load-format dummy a bundled config name "
        f"({', '.join(BUNDLED_CONFIGS)}); default: SmolLM2",
    )


def add_overhead_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--num-seqs",
        type=int,
        default=None,
        help="running sequences (default: --max-num-seqs)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=OverheadConfig.output_len,
        help="tokens each sequence decodes (default: %(default)s)",
    )
    p.add_argument(
        "--compare-kv-events",
        type=int,
        default=OverheadConfig.compare_kv_events,
        metavar="ROUNDS",
        help="compare KV-cache events off vs on over ROUNDS alternating runs (0: no)",
    )
    p.add_argument(
        "--compare-async",
        type=int,
        default=OverheadConfig.compare_async,
        metavar="ROUNDS",
        help="compare async scheduling off vs on over ROUNDS alternating runs: the share of "
        "the bookkeeping taken off the critical path (0: no)",
    )
    EngineArgs.add_cli_args(
        p, model_help="model (default: a tiny random Llama, whose forward pass is nearly free)"
    )


def add_serve_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=["grpc", "openai"],
        default=ServeBenchConfig.backend,
        help="grpc (--target) or the OpenAI-compatible REST API (--base-url) (default: "
        "%(default)s)",
    )
    p.add_argument("--target", default=ServeBenchConfig.target, help="gRPC host:port")
    p.add_argument("--base-url", default=ServeBenchConfig.base_url, help="OpenAI base URL")
    p.add_argument(
        "--model", default=ServeBenchConfig.model, help="model name for the OpenAI backend"
    )
    p.add_argument("--api-key", default=None, help="bearer key the server requires")
    add_workload_arguments(p, fleet=True)
    _add_fleet_arguments(p)
    p.add_argument(
        "--vocab-size",
        type=int,
        default=ServeBenchConfig.vocab_size,
        help="token ids of the prompts are drawn below this (default: %(default)s, SmolLM2's)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="model folder or hub id whose tokenizer renders the edit workload's chat prompts "
        "(default: the default model's)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=ServeBenchConfig.concurrency,
        help="requests in flight at most (default: %(default)s)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals per second (default: all at once, bounded by --concurrency)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=ServeBenchConfig.seed,
        help="seed of the arrival times (default: %(default)s)",
    )
    p.add_argument(
        "--cache-salt",
        default=None,
        help="cache_salt for every request (gRPC field; OpenAI backend: the "
        "vLLM-style body field; default: fresh per run, so runs never reuse "
        "each other's prefix cache)",
    )
    from tokenwire.clients.channel import add_tls_client_arguments

    add_tls_client_arguments(p)  # --tls, --tls-ca, --tls-cert, --tls-key, --tls-server-name


def _add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    from tokenwire.bench.fleet_workloads import FleetShape

    p.add_argument(
        "--text-prompts",
        action="store_true",
        help="OpenAI backend: send prompts as text decoded with --tokenizer (gateways such as "
        "SMG take only text prompts)",
    )
    p.add_argument(
        "--replica-metrics",
        nargs="+",
        default=[],
        metavar="URL",
        help="/metrics URL of every replica behind the target: report the run's prefix-cache "
        "hit rate over all of them",
    )
    for name, help_text in (
        ("conversations", "fleet workloads: conversations (--num-requests overrides)"),
        ("turns", "multiturn: turns per conversation; shared-prefix: requests per conversation"),
        ("first_prompt", "multiturn: tokens of a conversation's first message"),
        ("user_message", "multiturn: tokens each later turn's user message adds"),
        ("output_len", "fleet workloads: tokens each turn generates"),
        ("system_prompts", "shared-prefix: distinct system prompts"),
        ("system_len", "shared-prefix: tokens of each system prompt"),
        ("suffix_len", "shared-prefix: tokens of each request's own question"),
    ):
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=getattr(FleetShape, name),
            help=f"{help_text} (default: %(default)s)",
        )


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    p.add_argument(
        "--num-adapters",
        type=int,
        default=LoRABenchConfig.num_adapters,
        help="random adapters, mixed evenly",
    )
    p.add_argument(
        "--lora-rank", type=int, default=LoRABenchConfig.rank, help="rank of every adapter"
    )
    EngineArgs.add_cli_args(p, model_help="model (default: SmolLM2)")


def add_embed_arguments(p: argparse.ArgumentParser) -> None:
    defaults = EmbedBenchConfig()
    p.add_argument(
        "--num-sequences",
        type=int,
        default=defaults.num_sequences,
        help="texts embedded per model and side (default: %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        help="texts per engine batch (max_num_seqs) and per sentence-transformers "
        "batch (default: %(default)s)",
    )
    p.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per text")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=defaults.vocab_size,
        help="vocabulary of the random models; token ids are drawn below it (default: %(default)s)",
    )
    p.add_argument(
        "--models",
        default=",".join(defaults.models),
        help="comma-separated: bert (all-MiniLM-L6 shape), qwen3 (a decoder embedding model)",
    )
