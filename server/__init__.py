"""tokenwire server: gRPC services, REST shim, telemetry, CLI."""
