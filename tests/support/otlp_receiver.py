"""A real OTLP/gRPC trace receiver on loopback and span-attribute helpers."""

from __future__ import annotations

import threading
from collections.abc import Callable

from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects exported spans; ``wait_for`` blocks on a condition until a predicate holds."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.services: set[str] = set()
        self.cond = threading.Condition()

    def Export(self, request: object, context: object) -> object:
        with self.cond:
            for rs in request.resource_spans:  # type: ignore[attr-defined]
                for kv in rs.resource.attributes:
                    if kv.key == "service.name":
                        self.services.add(kv.value.string_value)
                for ss in rs.scope_spans:
                    self.spans.extend(ss.spans)
            self.cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, ready: Callable[[list[Span]], bool], timeout: float = 30.0) -> list[Span]:
        with self.cond:
            assert self.cond.wait_for(lambda: ready(self.spans), timeout), "spans never arrived"
            return list(self.spans)


def attrs(span: Span) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        else:
            out[kv.key] = getattr(value, kind)
    return out
