from google.rpc import status_pb2 as _status_pb2
from tokenwire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NoticeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NOTICE_KIND_UNSPECIFIED: _ClassVar[NoticeKind]
    NOTICE_KIND_DRAINING: _ClassVar[NoticeKind]
    NOTICE_KIND_CONTEXT_EVICTED: _ClassVar[NoticeKind]
    NOTICE_KIND_IDLE_TIMEOUT: _ClassVar[NoticeKind]
NOTICE_KIND_UNSPECIFIED: NoticeKind
NOTICE_KIND_DRAINING: NoticeKind
NOTICE_KIND_CONTEXT_EVICTED: NoticeKind
NOTICE_KIND_IDLE_TIMEOUT: NoticeKind

class GenerateRequest(_message.Message):
    __slots__ = ("model", "text", "token_ids", "chat", "sampling", "stopping", "output", "request_id", "cache_salt", "priority", "retain_kv_as", "truncate_prompt_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RETAIN_KV_AS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    token_ids: _common_pb2.TokenIds
    chat: _common_pb2.ChatInput
    sampling: _common_pb2.SamplingOptions
    stopping: _common_pb2.StoppingOptions
    output: _common_pb2.OutputOptions
    request_id: str
    cache_salt: str
    priority: int
    retain_kv_as: str
    truncate_prompt_tokens: int
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., chat: _Optional[_Union[_common_pb2.ChatInput, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingOptions, _Mapping]] = ..., stopping: _Optional[_Union[_common_pb2.StoppingOptions, _Mapping]] = ..., output: _Optional[_Union[_common_pb2.OutputOptions, _Mapping]] = ..., request_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., retain_kv_as: _Optional[str] = ..., truncate_prompt_tokens: _Optional[int] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("index", "text", "token_ids", "logprobs", "finish_reason", "stop_sequence", "stop_token_id", "tool_calls", "reasoning_content")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    finish_reason: _common_pb2.FinishReason
    stop_sequence: str
    stop_token_id: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    reasoning_content: str
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_sequence: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "model", "choices", "usage", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    usage: _common_pb2.Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("positions",)
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    def __init__(self, positions: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ...) -> None: ...

class StreamStart(_message.Message):
    __slots__ = ("request_id", "model", "prompt_tokens", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("index", "text", "token_ids", "logprobs", "tool_calls", "reasoning_text")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TEXT_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCallDelta]
    reasoning_text: str
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCallDelta, _Mapping]]] = ..., reasoning_text: _Optional[str] = ...) -> None: ...

class ChoiceEnd(_message.Message):
    __slots__ = ("index", "finish_reason", "stop_sequence", "stop_token_id", "completion_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    finish_reason: _common_pb2.FinishReason
    stop_sequence: str
    stop_token_id: int
    completion_tokens: int
    def __init__(self, index: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_sequence: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("start", "delta", "end", "usage", "prompt_logprobs")
    START_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    start: StreamStart
    delta: TokenDelta
    end: ChoiceEnd
    usage: _common_pb2.Usage
    prompt_logprobs: PromptLogprobs
    def __init__(self, start: _Optional[_Union[StreamStart, _Mapping]] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., end: _Optional[_Union[ChoiceEnd, _Mapping]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("model", "sampling", "stopping", "output", "system_prompt", "cache_salt", "history", "history_token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    sampling: _common_pb2.SamplingOptions
    stopping: _common_pb2.StoppingOptions
    output: _common_pb2.OutputOptions
    system_prompt: str
    cache_salt: str
    history: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    history_token_ids: _common_pb2.TokenIds
    def __init__(self, model: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingOptions, _Mapping]] = ..., stopping: _Optional[_Union[_common_pb2.StoppingOptions, _Mapping]] = ..., output: _Optional[_Union[_common_pb2.OutputOptions, _Mapping]] = ..., system_prompt: _Optional[str] = ..., cache_salt: _Optional[str] = ..., history: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., history_token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ...) -> None: ...

class UserContent(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[_common_pb2.ContentPart]
    def __init__(self, parts: _Optional[_Iterable[_Union[_common_pb2.ContentPart, _Mapping]]] = ...) -> None: ...

class SessionTurn(_message.Message):
    __slots__ = ("text", "token_ids", "user_message", "user_content", "sampling", "stopping", "output", "traceparent", "tracestate")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    USER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    USER_CONTENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _common_pb2.TokenIds
    user_message: str
    user_content: UserContent
    sampling: _common_pb2.SamplingOptions
    stopping: _common_pb2.StoppingOptions
    output: _common_pb2.OutputOptions
    traceparent: str
    tracestate: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., user_message: _Optional[str] = ..., user_content: _Optional[_Union[UserContent, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingOptions, _Mapping]] = ..., stopping: _Optional[_Union[_common_pb2.StoppingOptions, _Mapping]] = ..., output: _Optional[_Union[_common_pb2.OutputOptions, _Mapping]] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class SessionCancelTurn(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionClose(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "turn", "cancel_turn", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_TURN_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    turn: SessionTurn
    cancel_turn: SessionCancelTurn
    close: SessionClose
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., turn: _Optional[_Union[SessionTurn, _Mapping]] = ..., cancel_turn: _Optional[_Union[SessionCancelTurn, _Mapping]] = ..., close: _Optional[_Union[SessionClose, _Mapping]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id", "model", "max_context_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    max_context_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., max_context_tokens: _Optional[int] = ...) -> None: ...

class TurnStarted(_message.Message):
    __slots__ = ("turn", "request_id", "prompt_tokens", "cached_tokens")
    TURN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    turn: int
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    def __init__(self, turn: _Optional[int] = ..., request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TurnDelta(_message.Message):
    __slots__ = ("turn", "delta")
    TURN_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    turn: int
    delta: TokenDelta
    def __init__(self, turn: _Optional[int] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ...) -> None: ...

class TurnEnd(_message.Message):
    __slots__ = ("turn", "index", "finish_reason", "stop_sequence", "stop_token_id", "usage", "error")
    TURN_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    turn: int
    index: int
    finish_reason: _common_pb2.FinishReason
    stop_sequence: str
    stop_token_id: int
    usage: _common_pb2.Usage
    error: _status_pb2.Status
    def __init__(self, turn: _Optional[int] = ..., index: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_sequence: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class SessionNotice(_message.Message):
    __slots__ = ("kind", "message")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    kind: NoticeKind
    message: str
    def __init__(self, kind: _Optional[_Union[NoticeKind, str]] = ..., message: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("opened", "turn_started", "delta", "turn_end", "notice")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    TURN_STARTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    TURN_END_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    turn_started: TurnStarted
    delta: TurnDelta
    turn_end: TurnEnd
    notice: SessionNotice
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., turn_started: _Optional[_Union[TurnStarted, _Mapping]] = ..., delta: _Optional[_Union[TurnDelta, _Mapping]] = ..., turn_end: _Optional[_Union[TurnEnd, _Mapping]] = ..., notice: _Optional[_Union[SessionNotice, _Mapping]] = ...) -> None: ...
