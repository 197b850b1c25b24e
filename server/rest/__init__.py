"""The OpenAI-compatible REST shim: a FastAPI app over the gRPC API (no model, no engine)."""
