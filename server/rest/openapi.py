"""The shim's ``/openapi.json``: FastAPI's schema, with the error responses the shim really
sends (the OpenAI envelope on 400/401/403/404/409/413/429/500/503/504) instead of FastAPI's 422
validation shape, which this API never returns."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

_ERRORS = {
    "400": "invalid request (bad JSON, wrong type, unknown or unsupported field, bad value)",
    "401": "missing or invalid API key",
    "403": "LoRA adapter loading is off (--allow-runtime-lora-updating)",
    "404": "unknown model, LoRA adapter or route",
    "409": "a request with this x-request-id is in flight, or a LoRA adapter of this name "
    "is loaded",
    "413": "request body too large",
    "429": "queue full; see the Retry-After header",
    "500": "internal error",
    "503": "server not ready, draining, or its engine failed",
    "504": "the request timed out",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def install_openapi(app: FastAPI) -> None:
    """Build the schema once (FastAPI caches it) and rewrite its error responses."""
    schema: dict[str, Any] = app.openapi()
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    definition = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(definition.pop("$defs", {}))
    components["ErrorResponse"] = definition
    envelope = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status, description in _ERRORS.items():
                responses[status] = {"description": description, "content": envelope}
