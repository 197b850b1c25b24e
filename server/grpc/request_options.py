"""Request options of a ``GenerateRequest`` beyond sampling: chat-template variables
(``ChatInput.chat_template_kwargs_json``, ``reasoning_effort``), KV retention
(``retain_kv_as``: the holder id a finished request's blocks stay under).

Template variables are a JSON object whose keys become Jinja variables of the chat template
(vLLM's ``chat_template_kwargs``); the names the renderer itself sets are refused by name, so
a request cannot switch off the generation prompt or swap the template.
"""

from __future__ import annotations

import json
from typing import Any

from tokenwire.runtime.errors import ParameterError, clip
from tokenwire.v1 import common_pb2

MAX_TEMPLATE_KWARGS_BYTES = 64 << 10
MAX_RETAIN_KEY_CHARS = 128
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# Set by the renderer: a request may not override them.
_RESERVED = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "tokenizer_kwargs",
    }
)


def template_kwargs(chat: common_pb2.ChatInput) -> dict[str, Any] | None:
    """The chat template's extra variables of ``chat``; None when there are none."""
    kwargs: dict[str, Any] = {}
    raw = chat.chat_template_kwargs_json
    if raw:
        if len(raw) > MAX_TEMPLATE_KWARGS_BYTES:
            raise ParameterError(
                "chat_template_kwargs", f"at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON"
            )
        try:
            parsed = json.loads(raw)
        except ValueError:
            raise ParameterError("chat_template_kwargs", "must be a JSON object") from None
        if not isinstance(parsed, dict):
            raise ParameterError("chat_template_kwargs", "must be a JSON object")
        for key in parsed:
            if key in _RESERVED or not key.isidentifier():
                raise ParameterError(
                    "chat_template_kwargs",
                    f"{clip(key)!r} cannot be set (a reserved or non-identifier name)",
                )
        kwargs.update(parsed)
    if chat.reasoning_effort:
        if chat.reasoning_effort not in REASONING_EFFORTS:
            raise ParameterError(
                "reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}"
            )
        kwargs.setdefault("reasoning_effort", chat.reasoning_effort)
    return kwargs or None


def retained_holder(caller: str, key: str) -> str | None:
    """The engine holder id of ``retain_kv_as`` ``key`` for ``caller`` (None: not asked).
    Namespaced by caller, so one tenant can neither reach nor release another's."""
    if not key:
        return None
    if len(key) > MAX_RETAIN_KEY_CHARS or not key.isprintable():
        raise ParameterError(
            "retain_kv_as", f"must be printable and at most {MAX_RETAIN_KEY_CHARS} characters"
        )
    return f"retain/{caller}/{key}"
