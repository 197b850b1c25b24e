"""``tokenwire`` command line: ``serve``, ``rest`` (the REST shim alone), ``generate`` (offline),
``chat``, ``worker`` (tensor-parallel ranks of nodes other than 0), ``hash-key`` (an API key's
``--api-key-file`` form), ``bench ...``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from tokenwire.runtime.engine_args import EngineArgs


def _add_generate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("generate", help="generate text offline and stream it to stdout")
    p.add_argument("prompt", help="prompt text (a user message with --chat)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="tokens to generate at most (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (default: %(default)s, greedy)",
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s, off)"
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="sample among the k likeliest tokens (default: %(default)s, off)",
    )
    # Every engine flag; the model is --model here (the positional is the prompt), and
    # --seed seeds the engine's sampling generator (and dummy weights).
    EngineArgs.add_cli_args(p, model_positional=False)
    p.set_defaults(func=_run_generate)


def generate_engine_args(args: argparse.Namespace) -> EngineArgs:
    """``generate``'s engine: one prompt, one sequence. Without ``--kv-cache-memory`` the CPU
    cache holds what that sequence can use (one ``--max-model-len`` of blocks, at most the
    default budget) instead of the server's 2 GiB, most of which it would never touch."""
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.kv_cache_memory == EngineArgs.kv_cache_memory:  # not given
        engine_args = dataclasses.replace(engine_args, kv_cache_memory=None, max_num_seqs=1)
    return engine_args


def _run_generate(args: argparse.Namespace) -> int:
    from tokenwire.runtime.llm import LLM
    from tokenwire.runtime.sampling_params import SamplingParams

    llm = LLM.from_engine_args(generate_engine_args(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    )
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = llm.frontend.render_chat([{"role": "user", "content": args.prompt}])
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _add_worker(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "worker",
        help="run this node's tensor-parallel ranks (every node but 0; node 0 runs serve)",
        description="Run the ranks of node --node-rank of a tensor-parallel engine whose "
        "node 0 runs `tokenwire serve` with the same engine flags.",
    )
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_worker)


def _run_worker(args: argparse.Namespace) -> int:
    import logging

    from tokenwire.runtime.executor.node import run_node

    config = EngineArgs.from_cli_args(args).create_engine_config()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    return run_node(config)


def _add_hash_key(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "hash-key",
        help="print the sha256:<hex> form of an API key for --api-key-file",
        description="Hash an API key for the keys list of --api-key-file. Without KEY, the "
        "key is read from the first line of stdin (keeps it out of the shell history).",
    )
    p.add_argument("key", nargs="?", default=None, help="the key (default: read stdin)")
    p.set_defaults(func=_run_hash_key)


def _run_hash_key(args: argparse.Namespace) -> int:
    from tokenwire.server.tenants.config import hash_key

    key = args.key if args.key is not None else sys.stdin.readline().rstrip("\r\n")
    if not key:
        raise ValueError("hash-key: the key is empty")
    print(hash_key(key))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from tokenwire.bench.cli import add_parsers as add_bench_parsers
    from tokenwire.clients.chat import add_chat_parser
    from tokenwire.server.rest.server import add_rest_parser
    from tokenwire.server.serve import add_serve_parser

    parser = argparse.ArgumentParser(prog="tokenwire", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_rest_parser(sub)
    _add_generate(sub)
    add_chat_parser(sub)
    _add_worker(sub)
    _add_hash_key(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    add_bench_parsers(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as exc:  # configuration errors name the flag to change
        print(f"tokenwire: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
