"""The ``POST /v1/responses`` body (OpenAI's Responses API), as strict pydantic models.

The shim's rule for fields holds here too: unknown fields are 400s by name; a field that
cannot change the answer is accepted (``metadata``, ``user``, ``safety_identifier``,
``service_tier``, ``prompt_cache_key``, ``prompt_cache_retention``, ``include_obfuscation``);
one that would change it and is not implemented passes only as ``null`` or its no-op value
(``background`` false, ``truncation`` "disabled", ``include`` empty, ``reasoning.summary``).
The sampling and stopping fields, vLLM's extras included, are chat's (``SamplingFields``).

``input`` is a string (one user message) or a list of items: messages (``type`` "message" or
no type; roles user, assistant, system, developer; content a string or ``input_text`` /
``output_text`` parts, and ``input_image`` parts in user messages: a base64 ``data:`` URL in
``image_url``, as chat's ``image_url`` parts), ``function_call`` (an earlier call of the model)
and ``function_call_output`` (its result: text, or text and ``input_image`` parts), and
``reasoning`` items (an earlier turn's reasoning: accepted and not shown to the model, as chat
templates drop it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator
from pydantic_core import PydanticCustomError

from tokenwire.server.rest.body_base import U32, _bad_text_path, _Strict
from tokenwire.server.rest.errors import NOT_UNICODE
from tokenwire.server.rest.field_types import FalseOnly, Unsupported
from tokenwire.server.rest.models import SamplingFields


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier output_text's (none are produced)
    logprobs: list[Any] | None = None


class InputImage(_Strict):
    """An image: ``image_url`` a base64 ``data:`` URL, or an ``http(s)`` URL of a host in
    ``--allowed-media-domains`` (``remote_images``); ``file_id`` is refused (no Files API)."""

    type: Literal["input_image"]
    image_url: str | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None  # the processor decides
    file_id: str | None = None  # refused when set, naming the part (no Files API here)
    prompt_cache_breakpoint: dict[str, Any] | None = None  # accepted and ignored


MessagePart = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[MessagePart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, InputText))

    def has_images(self) -> bool:
        return not isinstance(self.content, str) and any(
            isinstance(part, InputImage) for part in self.content
        )


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    """A tool's result: text, or ``input_text`` and ``input_image`` parts (OpenAI's schema
    allows images there: a screenshot tool's output); the image lands in the tool message."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[MessagePart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output if isinstance(part, InputText))

    def has_images(self) -> bool:
        return not isinstance(self.output, str) and any(
            isinstance(part, InputImage) for part in self.output
        )


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: Unsupported = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function_call", "function_call_output", "reasoning") else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """``text`` (no constraint), ``json_object`` or ``json_schema`` (name + schema)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Unsupported = None


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Unsupported = None
    generate_summary: Unsupported = None


class ResponseStreamOptions(_Strict):
    include_obfuscation: bool | None = None  # accepted and ignored (no padding is added)


class ResponsesRequest(SamplingFields):
    """The sampling fields (vLLM's extras included: ``stop``, ``ignore_eos``, ``top_k``,
    ``min_p``, ``repetition_penalty``, ``priority``, ...) are chat's, applied the same way."""

    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # true (OpenAI's default): kept for GET and continuation
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    max_output_tokens: U32 | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    # accepted and ignored (they cannot change the answer)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # only their no-op values
    background: FalseOnly = None
    truncation: Literal["disabled"] | None = None
    include: Annotated[list[str], Field(max_length=0)] | None = None
    # not implemented
    conversation: Unsupported = None
    prompt: Unsupported = None
    max_tool_calls: Unsupported = None
    top_logprobs: Unsupported = None
    context_management: Unsupported = None
    moderation: Unsupported = None

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        path = _bad_text_path(value)
        if path is not None:
            raise PydanticCustomError("invalid_unicode", NOT_UNICODE, {"path": path})
        return value
