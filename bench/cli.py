"""``tokenwire bench throughput|overhead|serve|lora|embed|llamacpp``: the command-line edge.

With ``cli_args`` (the sub-commands' flags) and ``llamacpp_cli``, the only modules of the
package that see ``argparse``: each command's flags become a frozen config (``ThroughputConfig``,
``OverheadConfig``, ``ServeBenchConfig``) and the benchmark runs on that. The offline benchmarks
take every engine flag (``EngineArgs``), like ``serve``. Benchmark modules import torch, so they
load only when their command runs; the flags' defaults are read from the (torch-free) configs
in ``bench/configs.py``.
"""

from __future__ import annotations

import argparse

from tokenwire.bench.cli_args import (
    add_embed_arguments,
    add_lora_arguments,
    add_overhead_arguments,
    add_serve_bench_arguments,
    add_throughput_arguments,
)
from tokenwire.bench.configs import (
    EmbedBenchConfig,
    HfBaselineConfig,
    LoRABenchConfig,
    OverheadConfig,
    ServeBenchConfig,
    ThroughputConfig,
)
from tokenwire.runtime.engine_args import EngineArgs


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
