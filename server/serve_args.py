"""The ``tokenwire serve`` flags (beyond the engine's own, ``runtime/engine_args.py``) and
the gRPC server and process settings they make. Each flag's default is the field default of
the settings dataclass it fills (``GrpcSettings``, ``Limits``, ``ServeOptions``, ...), written
once there."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from tokenwire.runtime.config import DEFAULT_MAX_REQUESTS
from tokenwire.runtime.engine_args import EngineArgs
from tokenwire.server.grpc.connection import add_connection_arguments, connection_settings
from tokenwire.server.grpc.convert import Limits
from tokenwire.server.grpc.images import ImageLimits
from tokenwire.server.grpc.server import WORKER_PROTOCOLS, GrpcSettings
from tokenwire.server.rest.app import RestSettings
from tokenwire.server.rest.connection import HttpConnectionSettings, http_connection_settings
from tokenwire.server.rest.server import add_rest_arguments
from tokenwire.server.telemetry.engine_gauges import METRICS_COMPAT
from tokenwire.server.telemetry.logs import add_log_format_argument
from tokenwire.server.telemetry.tracing import add_tracing_arguments
from tokenwire.server.tenants.config import load_tenant_file
from tokenwire.server.tls.settings import add_ssl_arguments
from tokenwire.server.tool_parsers.names import reasoning_parser_help, tool_parser_help
from tokenwire.server.tool_parsers.output import REASONING_PARSERS, TOOL_PARSERS


@dataclass(frozen=True)
class ServeOptions:
    """Process-level serve flags (the engine's own are in ``EngineConfig``)."""

    max_requests: int = DEFAULT_MAX_REQUESTS
    shutdown_timeout: float = 30.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    engine_in_process: bool = False
    http: HttpConnectionSettings = field(default_factory=HttpConnectionSettings)
    reload_interval: float | None = None  # poll the reloadable files (None: SIGHUP only)
    metrics_compat: str = "both"  # /metrics names: tokenwire:*, vllm:* or both


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``tokenwire serve`` flag, MODEL and the engine's flags included."""
    _add_listen_arguments(p)
    add_rest_arguments(p)
    EngineArgs.add_cli_args(p)  # MODEL and every engine flag (runtime/engine_args.py)
    _add_key_arguments(p)
    _add_request_limit_arguments(p)
    add_connection_arguments(p)  # gRPC keepalive, connection age, message sizes, RPC cap
    add_ssl_arguments(p)
    _add_admission_arguments(p)
    _add_chat_parser_arguments(p)
    _add_lora_arguments(p)
    _add_replica_arguments(p)
    _add_lifecycle_arguments(p)
    add_log_format_argument(p)
    _add_metrics_arguments(p)
    _add_deployment_arguments(p)
    add_tracing_arguments(p)


def _add_listen_arguments(p: argparse.ArgumentParser) -> None:
    """The gRPC and REST addresses: --host, --grpc-port, --port, --disable-rest."""
    p.add_argument(
        "--host",
        default=GrpcSettings.host,
        help="address the gRPC and REST ports bind (and --metrics-port, unless --metrics-host)",
    )
    p.add_argument(
        "--grpc-port", type=int, default=GrpcSettings.port, help="gRPC port (0: any free port)"
    )
    p.add_argument(
        "--port", type=int, default=RestSettings.port, help="REST port (0: any free port)"
    )
    p.add_argument("--disable-rest", action="store_true", help="serve gRPC only")


def _add_key_arguments(p: argparse.ArgumentParser) -> None:
    """Who may call: --api-key and the tenants' --api-key-file."""
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="required bearer key (repeatable; also TOKENWIRE_API_KEY); with --api-key-file "
        "these keys form the tenant 'default' (no limits)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="tenants (YAML or TOML): hashed keys, allowed models, max priority, rate limits "
        "(docs/tls-and-tenants.md#tenants-and-rate-limits); reloaded on SIGHUP",
    )


def _add_request_limit_arguments(p: argparse.ArgumentParser) -> None:
    """What one request or message may carry: choices, stop sequences, prompt bytes, images
    and the gRPC message size."""
    p.add_argument(
        "--max-n",
        type=int,
        default=Limits.max_n,
        help="most choices (n) one request may ask for (default: %(default)s)",
    )
    p.add_argument(
        "--max-stop-sequences",
        type=int,
        default=Limits.max_stop_sequences,
        help="most stop sequences one request may give (default: %(default)s)",
    )
    p.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=None,
        help="prompt text (UTF-8 bytes) refused before tokenizing; default 32 per context token",
    )
    p.add_argument(
        "--max-images-per-request",
        type=int,
        default=ImageLimits.max_images,
        help="most image parts one chat request may carry (vision models; default: %(default)s)",
    )
    p.add_argument(
        "--max-image-bytes",
        type=int,
        default=ImageLimits.max_bytes,
        help="largest encoded image accepted, in bytes (default: %(default)s)",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=ImageLimits.max_pixels,
        help="most pixels (width x height, read from the image's header before decoding) "
        "of one image (default: %(default)s)",
    )
    p.add_argument(
        "--mm-processor-cache-bytes",
        type=int,
        default=ImageLimits.processor_cache_bytes,
        help="processed images (the image processor's output, by the image's bytes) kept for "
        "chats that carry them again, LRU; 0: off (default: %(default)s)",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=GrpcSettings.max_message_bytes,
        help="gRPC message size limit in bytes, both directions (default: %(default)s; per "
        "direction: --max-receive-message-bytes, --max-send-message-bytes)",
    )


def _add_admission_arguments(p: argparse.ArgumentParser) -> None:
    """In-flight sequences before new requests are refused: --max-requests."""
    p.add_argument(
        "--max-requests",
        type=int,
        default=ServeOptions.max_requests,
        help="in-flight sequences before RESOURCE_EXHAUSTED (a request with n choices counts n)",
    )


def _add_chat_parser_arguments(p: argparse.ArgumentParser) -> None:
    """Chat output readers: --tool-call-parser and --reasoning-parser."""
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="read tool calls out of chat output when tool_choice is auto; default: the one "
        "the model's chat template implies (hermes for a template without tools), or none when "
        "its tool format is unknown (tool_choice auto is then refused). Formats: "
        + tool_parser_help(),
    )
    p.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split the model's reasoning from chat answers (reasoning_content): "
        + reasoning_parser_help(),
    )


def _add_lora_arguments(p: argparse.ArgumentParser) -> None:
    """Runtime LoRA loading: --allow-runtime-lora-updating and --lora-root."""
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="allow loading / unloading LoRA adapters at runtime (gRPC ModelService.LoadAdapter "
        "/ UnloadAdapter, REST /v1/load_lora_adapter, /v1/unload_lora_adapter); needs "
        "--enable-lora, --api-key and --lora-root",
    )
    p.add_argument(
        "--lora-root",
        default=None,
        metavar="DIR",
        help="runtime-loaded adapters must lie inside this directory (lora_path is resolved "
        "against it; .. and symlinks cannot leave it)",
    )


def _add_replica_arguments(p: argparse.ArgumentParser) -> None:
    """This replica's fleet id and its gRPC Session streams: --replica-id, --max-sessions,
    --session-idle-timeout."""
    p.add_argument(
        "--replica-id",
        default=None,
        help="this server's id in a fleet, shown by GetServerInfo and /v1/models "
        "(default: HOSTNAME-PID, stable for the process's life)",
    )
    p.add_argument(
        "--max-sessions",
        type=int,
        default=GrpcSettings.max_sessions,
        help="gRPC Session streams open at once before new ones get RESOURCE_EXHAUSTED "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--session-idle-timeout",
        type=float,
        default=GrpcSettings.session_idle_timeout,
        help="seconds a gRPC Session may go without a turn before it is closed (default: "
        "%(default)s)",
    )


def _add_lifecycle_arguments(p: argparse.ArgumentParser) -> None:
    """Shutdown and reload: --shutdown-timeout and --reload-interval."""
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=ServeOptions.shutdown_timeout,
        help="seconds in-flight requests get to finish after SIGTERM / SIGINT (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--reload-interval",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="also reload (as on SIGHUP) when the TLS files or --api-key-file change, "
        "checked this often: for Kubernetes Secret volumes, which change without a signal "
        "(default: SIGHUP only)",
    )


def _add_metrics_arguments(p: argparse.ArgumentParser) -> None:
    """Prometheus /metrics: --metrics-port, --metrics-compat, --metrics-host."""
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics on this port only, without auth (default: on the "
        "REST --port, where it needs the API key when --api-key is set)",
    )
    p.add_argument(
        "--metrics-compat",
        choices=METRICS_COMPAT,
        default=ServeOptions.metrics_compat,
        help="metric names on /metrics: tokenwire:*, vllm:* (what llm-d / Gateway API "
        "endpoint pickers read unchanged) or both (default: %(default)s)",
    )
    p.add_argument(
        "--metrics-host",
        default=None,
        help="bind address of --metrics-port (default: --host); keep it internal",
    )


def _add_deployment_arguments(p: argparse.ArgumentParser) -> None:
    """How the process runs and what else it serves: --engine-in-process, --worker-protocol."""
    p.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine core on a thread of the server process (debugging) instead of "
        "a process of its own",
    )
    p.add_argument(
        "--worker-protocol",
        choices=sorted(WORKER_PROTOCOLS),
        default=GrpcSettings.worker_protocol,
        help="also serve a gateway's worker protocol on the gRPC port, behind the same keys, "
        "TLS and health: vllm = vLLM's engine protocol (vllm.grpc.engine.VllmEngine), what "
        "SMG's grpc:// workers speak (docs/fleet.md); default: off",
    )


def serve_options(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        max_requests=args.max_requests,
        shutdown_timeout=args.shutdown_timeout,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host or args.host,
        engine_in_process=args.engine_in_process,
        http=http_connection_settings(args),
        reload_interval=args.reload_interval,
        metrics_compat=args.metrics_compat,
    )


def grpc_settings(args: argparse.Namespace) -> GrpcSettings:
    keys = list(args.api_key or [])
    if not keys and os.environ.get("TOKENWIRE_API_KEY"):
        keys = [os.environ["TOKENWIRE_API_KEY"]]
    tenants = None if args.api_key_file is None else load_tenant_file(args.api_key_file)
    return GrpcSettings(
        host=args.host,
        port=args.grpc_port,
        api_keys=tuple(keys),
        tenants=tenants,
        limits=Limits(
            max_n=args.max_n,
            max_stop_sequences=args.max_stop_sequences,
            max_prompt_bytes=args.max_prompt_bytes,
            images=ImageLimits(
                args.max_images_per_request,
                args.max_image_bytes,
                args.max_image_pixels,
                args.mm_processor_cache_bytes,
            ),
        ),
        max_message_bytes=args.max_message_bytes,
        max_sessions=args.max_sessions,
        session_idle_timeout=args.session_idle_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        lora_root=args.lora_root,
        connection=connection_settings(args),
        worker_protocol=args.worker_protocol,
        **({} if args.replica_id is None else {"replica_id": args.replica_id}),
    )


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value
