"""``tokenwire bench throughput|overhead|serve|lora|embed|llamacpp``: the command-line edge.

With ``llamacpp_cli``, the only modules of the package that see ``argparse``: each command's
flags become a frozen config (``ThroughputConfig``, ``OverheadConfig``, ``ServeBenchConfig``)
and the benchmark runs on that. The offline benchmarks take every engine flag (``EngineArgs``),
like ``serve``. Benchmark modules import torch, so they load only when their command runs;
the flags' defaults are read from the (torch-free) configs in ``bench/configs.py``.
"""

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


def add_parsers(bench: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = bench.add_parser("serve", help="online load against a running endpoint")
    add_serve_bench_arguments(s)
    s.set_defaults(func=_serve)
    t = bench.add_parser("throughput", help="offline engine throughput (optionally vs HF)")
    add_throughput_arguments(t)
    t.set_defaults(func=_throughput)
    o = bench.add_parser("overhead", help="engine overhead per step on a tiny model")
    add_overhead_arguments(o)
    o.set_defaults(func=_overhead)
    lo = bench.add_parser("lora", help="offline throughput with N LoRA adapters vs the base")
    add_lora_arguments(lo)
    lo.set_defaults(func=_lora)
    em = bench.add_parser("embed", help="embedding throughput vs sentence-transformers (CPU)")
    add_embed_arguments(em)
    em.set_defaults(func=_embed)
    from tokenwire.bench.llamacpp_cli import add_llamacpp_arguments

    ll = bench.add_parser("llamacpp", help="tokenwire vs llama.cpp's llama-server, same GGUF")
    add_llamacpp_arguments(ll)


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


def _embed(args: argparse.Namespace) -> int:
    from tokenwire.bench.embed import run_embed_bench

    return run_embed_bench(
        EmbedBenchConfig(
            num_sequences=args.num_sequences,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            vocab_size=args.vocab_size,
            models=tuple(m for m in args.models.split(",") if m),
        )
    )


def _add_workload_arguments(p: argparse.ArgumentParser, fleet: bool = False) -> None:
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


# ---------------------------------------------------------------------- throughput
def add_throughput_arguments(p: argparse.ArgumentParser) -> None:
    _add_workload_arguments(p)
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


def throughput_config(args: argparse.Namespace) -> ThroughputConfig:
    try:
        batch_sizes = tuple(int(b) for b in args.hf_batch_sizes.split(","))
    except ValueError:
        raise ValueError(
            f"--hf-batch-sizes must be comma-separated integers, got {args.hf_batch_sizes!r}"
        ) from None
    return ThroughputConfig(
        engine=EngineArgs.from_cli_args(args),
        workload=args.workload,
        num_requests=args.num_requests,
        compare=args.compare,
        hf=HfBaselineConfig(
            batch_sizes=batch_sizes,
            num_requests=args.hf_num_requests,
            sequential_requests=args.hf_sequential_requests,
        ),
        floor_device=args.floor_device,
        tpot=args.tpot,
    )


def _throughput(args: argparse.Namespace) -> int:
    from tokenwire.bench.throughput import run_throughput

    return run_throughput(throughput_config(args))


# ---------------------------------------------------------------------- overhead
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


def overhead_config(args: argparse.Namespace) -> OverheadConfig:
    return OverheadConfig(
        engine=EngineArgs.from_cli_args(args),
        num_seqs=args.num_seqs,
        output_len=args.output_len,
        compare_kv_events=args.compare_kv_events,
        compare_async=args.compare_async,
    )


def _overhead(args: argparse.Namespace) -> int:
    config = overhead_config(args)
    if config.compare_kv_events:
        from tokenwire.bench.kv_events_cost import run_kv_events_cost

        return run_kv_events_cost(config, config.compare_kv_events)
    if config.compare_async:
        from tokenwire.bench.async_overlap import run_async_overlap

        return run_async_overlap(config, config.compare_async)
    from tokenwire.bench.overhead import run_overhead

    return run_overhead(config)


# ---------------------------------------------------------------------- serve
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
    _add_workload_arguments(p, fleet=True)
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


def serve_bench_config(args: argparse.Namespace) -> ServeBenchConfig:
    from tokenwire.bench.fleet_workloads import FleetShape
    from tokenwire.clients.channel import tls_from_args

    return ServeBenchConfig(
        backend=args.backend,
        target=args.target,
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        workload=args.workload,
        num_requests=args.num_requests,
        vocab_size=args.vocab_size,
        tokenizer=args.tokenizer,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        cache_salt=args.cache_salt,
        tls=tls_from_args(args),
        text_prompts=args.text_prompts,
        replica_metrics=tuple(args.replica_metrics),
        fleet=FleetShape(
            args.conversations,
            args.turns,
            args.first_prompt,
            args.user_message,
            args.output_len,
            args.system_prompts,
            args.system_len,
            args.suffix_len,
        ),
    )


def _serve(args: argparse.Namespace) -> int:
    from tokenwire.bench.serve import run_serve_bench

    return run_serve_bench(serve_bench_config(args))


# ---------------------------------------------------------------------- lora
def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    _add_workload_arguments(p)
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


def lora_config(args: argparse.Namespace) -> LoRABenchConfig:
    if args.num_adapters <= 0 or args.lora_rank <= 0:
        raise ValueError("--num-adapters and --lora-rank must be positive")
    return LoRABenchConfig(
        engine=EngineArgs.from_cli_args(args),
        workload=args.workload,
        num_requests=args.num_requests,
        num_adapters=args.num_adapters,
        rank=args.lora_rank,
    )


def _lora(args: argparse.Namespace) -> int:
    from tokenwire.bench.lora import run_lora_bench

    return run_lora_bench(lora_config(args))
