"""Telemetry: OpenTelemetry traces, Prometheus metrics, structlog logs."""
