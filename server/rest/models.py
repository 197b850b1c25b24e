"""OpenAI request bodies of the REST shim, as strict pydantic models.

Strict: wrong JSON types are 400s, never coerced (``"0.5"`` is not a number). Every integer
that travels in a proto field is range-checked here (uint32 ids, int32 top_k, uint64 seed),
so the gRPC message can always be built; whether a value makes sense (temperature >= 0, ids
inside the vocabulary, ...) is the gRPC server's call, in one place. Unknown fields are
rejected by name. The rule for fields OpenAI or vLLM define: one that cannot change the
answer is accepted (and ignored, or honoured where tokenwire has the feature); one that
would change it and is not implemented is accepted only as ``null`` or at its no-op value
and otherwise rejected by name, never silently ignored. Accepted and ignored: ``user``,
``safety_identifier``, ``metadata`` (labels), ``service_tier`` (one tier), ``store``
(nothing is stored), ``prompt_cache_key`` / ``prompt_cache_retention`` /
``prompt_cache_options`` (prefix caching is automatic; ``cache_salt`` isolates), ``prediction``
(a latency hint), ``include_obfuscation``
(no padding is added), ``guided_decoding_backend`` "auto"/"xgrammar" (the backend in use).
Every string anywhere in a request (fields, list items, content parts, keys) must be valid
Unicode: JSON can spell a lone UTF-16 surrogate (``"\\ud800"``), which protobuf cannot encode,
so it is a 400 naming the string's path, checked once for every field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tokenwire.server.rest.body_base import (
    I32,
    U32,
    U64,
    LogitBias,
    NonEmptyIds,
    _bad_text_path,
    _Strict,
    _TextBody,
)
from tokenwire.server.rest.content_parts import ContentPart, TextPart
from tokenwire.server.rest.errors import NOT_UNICODE
from tokenwire.server.rest.field_types import (
    EmptyOnly,
    FalseOnly,
    GrammarBackend,
    TextOnly,
    TrueOnly,
    Unsupported,
)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    # vLLM: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool | None = None
    include_obfuscation: bool | None = None  # accepted and ignored (no padding field)


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Strict):
    """``developer`` is OpenAI's newer name for ``system`` and is rendered as one. An
    assistant message may carry ``tool_calls`` (and no content); a ``tool`` message answers
    the call named by ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # image_url parts: a vision model's
    name: Unsupported = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: Unsupported = None
    refusal: Unsupported = None
    audio: Unsupported = None
    reasoning_content: str | None = None  # vLLM: a reasoning model's earlier turn; not shown

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("missing", "content is required for this message")
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("invalid_value", "only assistant messages have tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError("missing", "a tool message needs tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class Prediction(_Strict):
    """OpenAI's predicted output: a latency hint (accepted and ignored)."""

    type: Literal["content"]
    content: str | list[TextPart]


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``text`` (no constraint), ``json_object`` (any JSON object), ``json_schema``, or
    ``structural_tag`` (vLLM's shapes: ``format``, or the legacy ``structures`` +
    ``triggers``; their insides are checked by the server, errors naming response_format)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[Any] | None = None
    triggers: list[Any] | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError(
                "invalid_value", "json_schema is required exactly when type is json_schema"
            )
        tag_fields = (self.format, self.structures, self.triggers)
        if self.type != "structural_tag" and any(f is not None for f in tag_fields):
            raise PydanticCustomError(
                "invalid_value", "format, structures and triggers go with type structural_tag"
            )
        return self

    def structural_tag(self) -> dict[str, Any]:
        """The structural tag as sent (its shape is checked by the server)."""
        if self.format is not None:
            return {"type": "structural_tag", "format": self.format}
        legacy = {"structures": self.structures, "triggers": self.triggers}
        return {key: value for key, value in legacy.items() if value is not None}


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` extra: exactly one of the constraint fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool | None = None


class SamplingFields(_Strict):
    """The sampling and stopping fields shared by chat, completions and ``/v1/responses``
    (OpenAI's and vLLM's extras; ``requests.sampling_options`` and ``stopping_options``
    apply them)."""

    temperature: float | None = None
    top_p: float | None = None
    seed: U64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    # vLLM's request id and priority (lower runs first): as the x-request-id and x-priority
    # headers, which win when both are sent
    request_id: str | None = None
    priority: I32 | None = None
    # vLLM extras
    top_k: I32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: U32 | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[U32] | None = None
    include_stop_str_in_output: bool | None = None
    cache_salt: str | None = Field(
        default=None, description="requests with different salts never share prefix-cache blocks"
    )


class CommonFields(SamplingFields):
    """Fields shared by chat and completions, including vLLM's sampling extras."""

    model: str
    n: U32 | None = None
    logit_bias: LogitBias = None
    max_tokens: U32 | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # accepted and ignored (they cannot change the answer; see the module docstring)
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    skip_special_tokens: bool | None = None
    # vLLM's structured-output extras (one constraint per request, response_format included)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: GrammarBackend = None
    guided_whitespace_pattern: Unsupported = None
    # vLLM: logprobs of each prompt token with this many alternatives (not with stream)
    prompt_logprobs: U32 | None = None
    # vLLM: logprobs name tokens "token_id:<id>" instead of their text
    return_tokens_as_token_ids: bool | None = None
    # vLLM: keep the prompt's last k tokens (-1: the model's context length)
    truncate_prompt_tokens: I32 | None = None
    # vLLM: only these token ids may be sampled
    allowed_token_ids: NonEmptyIds | None = None
    # vLLM: words never to generate (tokenized by the server, with and without a space)
    bad_words: list[str] | None = None
    # vLLM fields tokenwire does not implement (their no-op value passes)
    use_beam_search: FalseOnly = None
    return_token_ids: FalseOnly = None
    structural_tag: str | None = None  # vLLM's older extra: a structural tag's JSON text
    logits_processors: Unsupported = None
    kv_transfer_params: Unsupported = None
    vllm_xargs: Unsupported = None

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """Every field, including the subclasses' (``messages``, ``prompt``), all the way down."""
        path = _bad_text_path(value)
        if path is not None:
            raise PydanticCustomError("invalid_unicode", NOT_UNICODE, {"path": path})
        return value


class ChatCompletionRequest(CommonFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: U32 | None = None
    logprobs: bool | None = None
    top_logprobs: U32 | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: Unsupported = None
    function_call: Unsupported = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # accepted and ignored (they cannot change the answer)
    prediction: Prediction | None = None
    # passed to the chat template as `reasoning_effort` (templates that do not use it ignore it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    prompt_cache_options: dict[str, Any] | None = None
    modalities: TextOnly = None
    # OpenAI fields tokenwire does not implement
    audio: Unsupported = None
    moderation: Unsupported = None
    verbosity: Unsupported = None
    web_search_options: Unsupported = None
    # vLLM's chat extras: only what tokenwire does anyway passes
    include_reasoning: TrueOnly = None
    add_generation_prompt: TrueOnly = None
    continue_final_message: FalseOnly = None
    add_special_tokens: FalseOnly = None  # the chat template adds the special tokens
    echo: FalseOnly = None
    documents: Unsupported = None
    chat_template: Unsupported = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra chat-template variables
    mm_processor_kwargs: Unsupported = None


class CompletionRequest(CommonFields):
    """``prompt``: a string, a list of strings, token ids, or a list of token-id lists.

    ``max_tokens`` defaults to 16 as at OpenAI and in vLLM (chat: until EOS/context).
    """

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | NonEmptyIds
        | Annotated[list[NonEmptyIds], Field(min_length=1)]
    )
    logprobs: U32 | None = None
    echo: bool | None = None  # the prompt's text before each choice's text
    best_of: U32 | None = None  # only equal to n (no extra candidates)
    suffix: EmptyOnly = None
    add_special_tokens: TrueOnly = None  # vLLM: the prompt is tokenized with them
    prompt_embeds: Unsupported = None

    @field_validator("best_of", mode="after")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != (info.data.get("n") or 1):
            raise PydanticCustomError(
                "unsupported_parameter", "only best_of equal to n is supported by tokenwire"
            )
        return value


class _AdapterBody(_TextBody):
    """The LoRA adapter routes' bodies."""


class LoadLoRAAdapterRequest(_AdapterBody):
    """vLLM's ``POST /v1/load_lora_adapter`` body (``lora_path``: inside ``--lora-root``)."""

    lora_name: str
    lora_path: str
    load_inplace: FalseOnly = None  # vLLM: replace an adapter of the same name (not here)


class UnloadLoRAAdapterRequest(_AdapterBody):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: str
    lora_int_id: Unsupported = None
