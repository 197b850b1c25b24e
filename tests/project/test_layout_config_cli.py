"""The command line says what every flag does and writes each default once (layout item 5):
every action of every ``tokenwire`` subcommand has help text; serve's and bench's flags take
their defaults from the settings dataclasses they fill (no number restated in
``add_argument``); the in-flight request cap (4096) is one constant."""

from __future__ import annotations

import argparse
import ast
import inspect
from collections.abc import Iterator
from pathlib import Path

from tokenwire.bench.configs import (
    HfBaselineConfig,
    LoRABenchConfig,
    OverheadConfig,
    ServeBenchConfig,
    ThroughputConfig,
)
from tokenwire.runtime.engine.async_engine import AsyncEngine
from tokenwire.server.cli import build_parser
from tokenwire.server.grpc.connection import ConnectionSettings
from tokenwire.server.grpc.convert import Limits
from tokenwire.server.grpc.images import ImageLimits
from tokenwire.server.grpc.server import GrpcSettings
from tokenwire.server.rest.app import RestSettings
from tokenwire.server.rest.connection import HttpConnectionSettings
from tokenwire.server.rest.media_fetch import MediaFetchPolicy
from tokenwire.server.serve_args import ServeOptions
from tokenwire.server.telemetry.tracing import TracingSettings

REPO = Path(__file__).resolve().parents[2]
# The modules that declare serve's (and rest's) own flags.
FLAG_MODULES = (
    "server/serve_args.py",
    "server/grpc/connection.py",
    "server/rest/server.py",
    "server/rest/connection.py",
    "server/telemetry/tracing.py",
    "bench/cli.py",
    "bench/cli_args.py",
)


def subcommands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield " ".join((*path, name)), sub
                yield from subcommands(sub, (*path, name))


def test_every_action_of_every_subcommand_has_help() -> None:
    missing = [
        (command, action.option_strings or action.dest)
        for command, parser in subcommands(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not (action.help or "").strip()
    ]
    assert missing == []


def test_the_walk_sees_every_subcommand() -> None:
    names = {command for command, _ in subcommands(build_parser())}
    expected = {"serve", "rest", "generate", "chat", "worker", "hash-key", "bench"}
    assert expected | {"bench throughput", "bench overhead", "bench serve", "bench lora"} <= names


def _literal_number(node: ast.expr) -> bool:
    """``7200.0``, ``16 << 20``, ``-1``: a number written in the source."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int | float) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _literal_number(node.operand)
    if isinstance(node, ast.BinOp):
        return _literal_number(node.left) and _literal_number(node.right)
    return False


def test_flag_defaults_are_not_restated_numbers() -> None:
    """A flag's numeric default is read from the settings dataclass it fills
    (``default=GrpcSettings.max_sessions``), never written a second time."""
    restated = []
    for rel in FLAG_MODULES:
        tree = ast.parse((REPO / rel).read_text(), rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                for kw in node.keywords:
                    if kw.arg == "default" and _literal_number(kw.value):
                        restated.append((rel, node.lineno, ast.unparse(node.args[0])))
    assert restated == []


def test_serve_parser_defaults_are_the_settings_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    expected = {
        "host": GrpcSettings.host,
        "grpc_port": GrpcSettings.port,
        "max_message_bytes": GrpcSettings.max_message_bytes,
        "max_sessions": GrpcSettings.max_sessions,
        "session_idle_timeout": GrpcSettings.session_idle_timeout,
        "max_n": Limits.max_n,
        "max_stop_sequences": Limits.max_stop_sequences,
        "max_image_pixels": ImageLimits.max_pixels,
        "mm_processor_cache_bytes": ImageLimits.processor_cache_bytes,
        "max_requests": ServeOptions.max_requests,
        "shutdown_timeout": ServeOptions.shutdown_timeout,
        "port": RestSettings.port,
        "max_request_body_bytes": RestSettings.max_body_bytes,
        "grpc_keepalive_time": ConnectionSettings.keepalive_time,
        "grpc_keepalive_timeout": ConnectionSettings.keepalive_timeout,
        "timeout_keep_alive": HttpConnectionSettings.timeout_keep_alive,
        "header_timeout": HttpConnectionSettings.header_timeout,
        "trace_step_sample_ratio": TracingSettings.step_sample_ratio,
    }
    assert {name: getattr(args, name) for name in expected} == expected
    # The values themselves are unchanged.
    assert (args.max_requests, args.grpc_port, args.max_message_bytes) == (4096, 50051, 16 << 20)
    assert args.allowed_media_domains is None  # no remote image URL is fetched


def test_rest_parser_defaults_are_the_settings_defaults() -> None:
    args = build_parser().parse_args(["rest"])
    expected = {
        "host": RestSettings.host,
        "port": RestSettings.port,
        "max_request_body_bytes": RestSettings.max_body_bytes,
        "max_image_bytes": MediaFetchPolicy.max_bytes,
        "allowed_media_domains": None,
    }
    assert {name: getattr(args, name) for name in expected} == expected


def test_bench_parser_defaults_are_the_bench_configs() -> None:
    parse = build_parser().parse_args
    serve = parse(["bench", "serve"])
    fields = ("backend", "target", "base_url", "model", "workload", "vocab_size", "concurrency")
    assert {f: getattr(serve, f) for f in fields} == {
        f: getattr(ServeBenchConfig, f) for f in fields
    }
    assert serve.seed == ServeBenchConfig.seed
    throughput = parse(["bench", "throughput"])
    assert (throughput.workload, throughput.compare, throughput.tpot) == (
        ThroughputConfig.workload,
        ThroughputConfig.compare,
        ThroughputConfig.tpot,
    )
    assert throughput.hf_sequential_requests == HfBaselineConfig.sequential_requests
    assert throughput.hf_batch_sizes == "16,32"
    assert parse(["bench", "overhead"]).output_len == OverheadConfig.output_len
    lora = parse(["bench", "lora"])
    assert (lora.num_adapters, lora.lora_rank) == (LoRABenchConfig.num_adapters, 16)


def _number_sites(value: int, folders: tuple[str, ...]) -> list[str]:
    """Where ``value`` is written as a number outside tuples (histogram buckets)."""
    sites = []
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            in_tuples = {
                id(n) for t in ast.walk(tree) if isinstance(t, ast.Tuple) for n in ast.walk(t)
            }
            sites += [
                f"{path.relative_to(REPO)}:{node.lineno}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Constant)
                and node.value == value
                and id(node) not in in_tuples
            ]
    return sites


def test_the_request_cap_is_written_once() -> None:
    sites = _number_sites(4096, ("runtime", "server"))
    assert [site.partition(":")[0] for site in sites] == ["runtime/config.py"], sites
    default = inspect.signature(AsyncEngine.__init__).parameters["max_requests"].default
    assert default == ServeOptions.max_requests == build_parser().parse_args(["serve"]).max_requests
