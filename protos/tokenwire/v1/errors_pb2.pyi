from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_PARAMETER: _ClassVar[ErrorReason]
    ERROR_REASON_CONTEXT_LENGTH_EXCEEDED: _ClassVar[ErrorReason]
    ERROR_REASON_MALFORMED_REQUEST: _ClassVar[ErrorReason]
    ERROR_REASON_API_KEY_INVALID: _ClassVar[ErrorReason]
    ERROR_REASON_MODEL_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_DUPLICATE_REQUEST_ID: _ClassVar[ErrorReason]
    ERROR_REASON_QUEUE_FULL: _ClassVar[ErrorReason]
    ERROR_REASON_TOO_MANY_SESSIONS: _ClassVar[ErrorReason]
    ERROR_REASON_TURN_IN_PROGRESS: _ClassVar[ErrorReason]
    ERROR_REASON_SERVER_DRAINING: _ClassVar[ErrorReason]
    ERROR_REASON_NOT_READY: _ClassVar[ErrorReason]
    ERROR_REASON_ENGINE_DEAD: _ClassVar[ErrorReason]
    ERROR_REASON_ENGINE_ERROR: _ClassVar[ErrorReason]
    ERROR_REASON_ADAPTER_EXISTS: _ClassVar[ErrorReason]
    ERROR_REASON_LORA_UPDATING_DISABLED: _ClassVar[ErrorReason]
    ERROR_REASON_RATE_LIMITED: _ClassVar[ErrorReason]
    ERROR_REASON_MODEL_NOT_ALLOWED: _ClassVar[ErrorReason]
    ERROR_REASON_RESPONSE_TOO_LARGE: _ClassVar[ErrorReason]
    ERROR_REASON_WRONG_TASK: _ClassVar[ErrorReason]
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_INVALID_PARAMETER: ErrorReason
ERROR_REASON_CONTEXT_LENGTH_EXCEEDED: ErrorReason
ERROR_REASON_MALFORMED_REQUEST: ErrorReason
ERROR_REASON_API_KEY_INVALID: ErrorReason
ERROR_REASON_MODEL_NOT_FOUND: ErrorReason
ERROR_REASON_DUPLICATE_REQUEST_ID: ErrorReason
ERROR_REASON_QUEUE_FULL: ErrorReason
ERROR_REASON_TOO_MANY_SESSIONS: ErrorReason
ERROR_REASON_TURN_IN_PROGRESS: ErrorReason
ERROR_REASON_SERVER_DRAINING: ErrorReason
ERROR_REASON_NOT_READY: ErrorReason
ERROR_REASON_ENGINE_DEAD: ErrorReason
ERROR_REASON_ENGINE_ERROR: ErrorReason
ERROR_REASON_ADAPTER_EXISTS: ErrorReason
ERROR_REASON_LORA_UPDATING_DISABLED: ErrorReason
ERROR_REASON_RATE_LIMITED: ErrorReason
ERROR_REASON_MODEL_NOT_ALLOWED: ErrorReason
ERROR_REASON_RESPONSE_TOO_LARGE: ErrorReason
ERROR_REASON_WRONG_TASK: ErrorReason
