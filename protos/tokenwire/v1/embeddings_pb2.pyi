from tokenwire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EmbeddingEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EMBEDDING_ENCODING_UNSPECIFIED: _ClassVar[EmbeddingEncoding]
    EMBEDDING_ENCODING_FLOAT: _ClassVar[EmbeddingEncoding]
    EMBEDDING_ENCODING_BYTES: _ClassVar[EmbeddingEncoding]
EMBEDDING_ENCODING_UNSPECIFIED: EmbeddingEncoding
EMBEDDING_ENCODING_FLOAT: EmbeddingEncoding
EMBEDDING_ENCODING_BYTES: EmbeddingEncoding

class TextInputs(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenInputs(_message.Message):
    __slots__ = ("inputs",)
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenIds]
    def __init__(self, inputs: _Optional[_Iterable[_Union[_common_pb2.TokenIds, _Mapping]]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("model", "texts", "tokens", "dimensions", "encoding", "request_id", "user", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    texts: TextInputs
    tokens: TokenInputs
    dimensions: int
    encoding: EmbeddingEncoding
    request_id: str
    user: str
    priority: int
    def __init__(self, model: _Optional[str] = ..., texts: _Optional[_Union[TextInputs, _Mapping]] = ..., tokens: _Optional[_Union[TokenInputs, _Mapping]] = ..., dimensions: _Optional[int] = ..., encoding: _Optional[_Union[EmbeddingEncoding, str]] = ..., request_id: _Optional[str] = ..., user: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("index", "values", "data", "prompt_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    values: _containers.RepeatedScalarFieldContainer[float]
    data: bytes
    prompt_tokens: int
    def __init__(self, index: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ..., data: _Optional[bytes] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class EmbeddingUsage(_message.Message):
    __slots__ = ("prompt_tokens", "total_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    total_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("request_id", "model", "data", "usage", "dimensions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    data: _containers.RepeatedCompositeFieldContainer[Embedding]
    usage: EmbeddingUsage
    dimensions: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., data: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., usage: _Optional[_Union[EmbeddingUsage, _Mapping]] = ..., dimensions: _Optional[int] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("model", "text_1", "text_2", "request_id", "user", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_1_FIELD_NUMBER: _ClassVar[int]
    TEXT_2_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    text_1: _containers.RepeatedScalarFieldContainer[str]
    text_2: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    user: str
    priority: int
    def __init__(self, model: _Optional[str] = ..., text_1: _Optional[_Iterable[str]] = ..., text_2: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., user: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class PairScore(_message.Message):
    __slots__ = ("index", "score", "prompt_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    score: float
    prompt_tokens: int
    def __init__(self, index: _Optional[int] = ..., score: _Optional[float] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("request_id", "model", "data", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    data: _containers.RepeatedCompositeFieldContainer[PairScore]
    usage: EmbeddingUsage
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., data: _Optional[_Iterable[_Union[PairScore, _Mapping]]] = ..., usage: _Optional[_Union[EmbeddingUsage, _Mapping]] = ...) -> None: ...
