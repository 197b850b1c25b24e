"""OpenTelemetry tracing setup: settings, the server-owned ``TracerProvider``, the exporter.

Tracing is on when ``--otlp-traces-endpoint`` is given or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
is set. OTLP over gRPC by default, ``--otlp-traces-protocol http/protobuf`` (or
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``) for OTLP/HTTP. The exporters and the batch span
processor read the other standard ``OTEL_*`` variables (headers, timeouts, batch sizes), the
provider reads ``OTEL_TRACES_SAMPLER``/``OTEL_RESOURCE_ATTRIBUTES``; the service name is
``tokenwire`` unless ``OTEL_SERVICE_NAME`` says otherwise. The provider is an object owned
by the server and passed down; the global OTel tracer provider is never set.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

Protocol = Literal["grpc", "http/protobuf"]
SERVICE_NAME = "tokenwire"


@dataclass(frozen=True)
class TracingSettings:
    endpoint: str | None = None  # None: tracing off
    protocol: Protocol = "grpc"
    step_sample_ratio: float = 1.0  # fraction of engine steps that get a span
    include_content: bool = False  # record prompt / completion text on request spans

    def __post_init__(self) -> None:
        if not 0.0 <= self.step_sample_ratio <= 1.0:
            raise ValueError("--trace-step-sample-ratio must lie in [0, 1]")

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None


def add_tracing_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="export traces over OTLP to this endpoint (e.g. http://jaeger:4317); default off",
    )
    p.add_argument(
        "--otlp-traces-protocol",
        choices=["grpc", "http/protobuf"],
        default=None,
        help="OTLP transport (default grpc, or OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)",
    )
    p.add_argument(
        "--trace-step-sample-ratio",
        type=float,
        default=TracingSettings.step_sample_ratio,
        help="fraction of engine steps traced as tokenwire.step spans (default 1: every step)",
    )
    p.add_argument(
        "--trace-include-content",
        action="store_true",
        help="record prompt and completion text on request spans (off: never recorded)",
    )


def tracing_settings(args: argparse.Namespace) -> TracingSettings:
    endpoint = args.otlp_traces_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    protocol = args.otlp_traces_protocol or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"
    )
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError("--otlp-traces-protocol must be grpc or http/protobuf")
    return TracingSettings(
        endpoint=endpoint or None,
        protocol=protocol,  # type: ignore[arg-type]
        step_sample_ratio=args.trace_step_sample_ratio,
        include_content=args.trace_include_content,
    )


def _exporter(settings: TracingSettings) -> SpanExporter:
    endpoint = settings.endpoint
    assert endpoint is not None
    if settings.protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        if urlsplit(endpoint).path in ("", "/"):  # a bare collector address
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )

    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    return GrpcExporter(endpoint=endpoint, insecure=parts.scheme != "https")


def build_tracer_provider(
    settings: TracingSettings, exporter: SpanExporter | None = None
) -> TracerProvider:
    """A provider exporting through a batch processor (``exporter`` overrides OTLP)."""
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(exporter or _exporter(settings)))
    return provider
