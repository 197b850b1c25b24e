"""Error mapping: runtime and server exceptions -> gRPC status with ``google.rpc`` details.

Every non-OK status carries a ``google.rpc.Status`` whose details hold an
``ErrorInfo{reason, domain: "tokenwire", metadata}`` (plus ``RetryInfo`` for QUEUE_FULL and a
tenant's RATE_LIMITED).
``reason`` is a ``tokenwire.v1.ErrorReason``; the wire carries its bare name ("QUEUE_FULL").
Unexpected exceptions become INTERNAL with a generic message naming the request id; the
details go to the server log only. No message carries a path, traceback or secret.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NoReturn

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from tokenwire.runtime.errors import (
    AdapterExistsError,
    AdapterNotFoundError,
    ContextLengthError,
    DrainingError,
    DuplicateRequestError,
    EngineDeadError,
    NotReadyError,
    ParameterError,
    QueueFullError,
    WrongTaskError,
    clip,
)
from tokenwire.server.tenants.limits import LimitExceeded, ModelNotAllowed
from tokenwire.v1 import errors_pb2
from tokenwire.v1.reasons import reason_name

DOMAIN = "tokenwire"
# An error's text never grows with client input: the whole status must fit in the trailers.
MAX_MESSAGE_CHARS = 1024
logger = logging.getLogger("tokenwire.server")


@dataclass
class ServiceError(Exception):
    """An error with a definite status; raise it anywhere in a handler."""

    code: grpc.StatusCode
    reason: errors_pb2.ErrorReason
    message: str
    metadata: dict[str, str] = field(default_factory=dict)
    retry_after: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)


def invalid_parameter(param: str, message: str) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.INVALID_ARGUMENT,
        errors_pb2.ERROR_REASON_INVALID_PARAMETER,
        f"{param}: {message}",
        {"param": param},
    )


# Runtime parameter names that the API spells differently (structured outputs).
_PROTO_PARAMS = {
    "structured_outputs": "structured_output",
    "structured_outputs.json": "structured_output.json_schema",
    "structured_outputs.json_object": "structured_output.json_object",
    "structured_outputs.regex": "structured_output.regex",
    "structured_outputs.choice": "structured_output.choice",
    "structured_outputs.grammar": "structured_output.grammar",
    "structured_outputs.structural_tag": "structured_output.structural_tag",
}


def renamed(exc: ParameterError, param: str) -> ParameterError:
    """The same error under another parameter name (message re-prefixed)."""
    message = str(exc).removeprefix(f"{exc.param}: ")
    return type(exc)(param, message)


def model_not_found(name: str) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.NOT_FOUND,
        errors_pb2.ERROR_REASON_MODEL_NOT_FOUND,
        f"model {clip(name)!r} is not served here",
        {"model": clip(name)},
    )


def tenant_error(exc: LimitExceeded | ModelNotAllowed) -> ServiceError:
    """A tenant's limit (RESOURCE_EXHAUSTED + RetryInfo) or model list. A model outside the
    caller's list is answered exactly like one that does not exist (NOT_FOUND, as OpenAI
    answers), so no tenant can learn which models and adapters other tenants have."""
    if isinstance(exc, ModelNotAllowed):
        return model_not_found(exc.model)
    return ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        errors_pb2.ERROR_REASON_RATE_LIMITED,
        str(exc),
        {"tenant": exc.tenant, "limit": exc.limit},
        retry_after=exc.retry_after,
    )


def to_service_error(exc: BaseException, request_id: str | None = None) -> ServiceError:
    """Classify an exception; unknown ones become a generic INTERNAL error."""
    if isinstance(exc, ServiceError):
        return exc
    known = _request_error(exc)
    if known is None:
        known = _availability_error(exc)
    if known is not None:
        return known
    logger.error("internal error (request_id=%s)", request_id, exc_info=exc)
    suffix = f" (request_id={request_id})" if request_id else ""
    return ServiceError(
        grpc.StatusCode.INTERNAL, errors_pb2.ERROR_REASON_ENGINE_ERROR, f"internal error{suffix}"
    )


def _request_error(exc: BaseException) -> ServiceError | None:
    """What the request itself got wrong: its length, a parameter, the model's task, an
    adapter name or a request id in use (None: not one of these)."""
    if isinstance(exc, ContextLengthError):
        return ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT,
            errors_pb2.ERROR_REASON_CONTEXT_LENGTH_EXCEEDED,
            str(exc),
            {"param": exc.param},
        )
    if isinstance(exc, ParameterError):
        if exc.param in _PROTO_PARAMS:
            exc = renamed(exc, _PROTO_PARAMS[exc.param])
        return ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT,
            errors_pb2.ERROR_REASON_INVALID_PARAMETER,
            str(exc),
            {"param": exc.param},
        )
    if isinstance(exc, WrongTaskError):
        return ServiceError(
            grpc.StatusCode.FAILED_PRECONDITION,
            errors_pb2.ERROR_REASON_WRONG_TASK,
            str(exc),
            {"model": clip(exc.model), "task": exc.task},
        )
    if isinstance(exc, AdapterExistsError):
        return ServiceError(
            grpc.StatusCode.ALREADY_EXISTS,
            errors_pb2.ERROR_REASON_ADAPTER_EXISTS,
            str(exc),
            {"param": "lora_name"},
        )
    if isinstance(exc, AdapterNotFoundError):  # unloaded between lookup and use, or unload
        return model_not_found(exc.name)
    if isinstance(exc, DuplicateRequestError):
        return ServiceError(
            grpc.StatusCode.ALREADY_EXISTS,
            errors_pb2.ERROR_REASON_DUPLICATE_REQUEST_ID,
            "a request with this request_id is already in flight",
        )
    return None


def _availability_error(exc: BaseException) -> ServiceError | None:
    """What the server cannot take now: a full queue, a tenant's limit or model list, an engine
    not ready, draining or dead (None: not one of these)."""
    if isinstance(exc, QueueFullError):
        return ServiceError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            errors_pb2.ERROR_REASON_QUEUE_FULL,
            str(exc),
            retry_after=exc.retry_after,
        )
    if isinstance(exc, LimitExceeded | ModelNotAllowed):
        return tenant_error(exc)
    if isinstance(exc, NotReadyError):
        return ServiceError(
            grpc.StatusCode.UNAVAILABLE,
            errors_pb2.ERROR_REASON_NOT_READY,
            str(exc),
            retry_after=1.0,
        )
    if isinstance(exc, DrainingError):
        return ServiceError(
            grpc.StatusCode.UNAVAILABLE, errors_pb2.ERROR_REASON_SERVER_DRAINING, str(exc)
        )
    if isinstance(exc, EngineDeadError):
        return ServiceError(
            grpc.StatusCode.UNAVAILABLE,
            errors_pb2.ERROR_REASON_ENGINE_DEAD,
            "the inference engine has failed; retry on another replica",
        )
    return None


def to_status_proto(err: ServiceError) -> status_pb2.Status:
    info = any_pb2.Any()
    info.Pack(
        error_details_pb2.ErrorInfo(
            reason=reason_name(err.reason),
            domain=DOMAIN,
            metadata={k: clip(v) for k, v in err.metadata.items()},
        )
    )
    details = [info]
    if err.retry_after is not None:
        retry = any_pb2.Any()
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(err.retry_after * 1e9))
        retry.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        details.append(retry)
    code = getattr(code_pb2, err.code.name)
    return status_pb2.Status(
        code=code, message=clip(err.message, MAX_MESSAGE_CHARS), details=details
    )


def to_grpc_status(err: ServiceError) -> grpc.Status:
    return rpc_status.to_status(to_status_proto(err))


async def abort(context: grpc.aio.ServicerContext, err: ServiceError) -> NoReturn:
    """End the call with ``err`` (raises grpc's AbortError, which callers let through)."""
    await context.abort_with_status(to_grpc_status(err))
    raise AssertionError("abort_with_status returned")  # pragma: no cover
