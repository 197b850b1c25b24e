"""Annotated types for request fields tokenwire implements only in part: a field it does not
implement passes only as ``null``, a flag only at the value tokenwire's behaviour already has
(``FalseOnly``, ``TrueOnly``), and a few fields only at their no-op value. Anything else is
a 400 (``unsupported_parameter``) naming the field, never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, WithJsonSchema
from pydantic_core import PydanticCustomError


def _reject(value: Any) -> None:
    if value is not None:
        raise PydanticCustomError(
            "unsupported_parameter", "this parameter is not supported by tokenwire"
        )


def _reject_true(value: bool | None) -> bool | None:
    if value:
        raise PydanticCustomError("unsupported_parameter", "only false is supported by tokenwire")
    return value


# An OpenAI field tokenwire does not implement: only null passes.
Unsupported = Annotated[
    Any,
    AfterValidator(_reject),
    WithJsonSchema({"type": "null", "description": "not supported by tokenwire"}),
]
# A flag tokenwire does not implement: only false/null pass.
FalseOnly = Annotated[bool | None, AfterValidator(_reject_true)]


def _reject_false(value: bool | None) -> bool | None:
    if value is False:
        raise PydanticCustomError("unsupported_parameter", "only true is supported by tokenwire")
    return value


# A flag whose default (true) is all tokenwire does: only true/null pass.
TrueOnly = Annotated[bool | None, AfterValidator(_reject_false)]


def _text_modality(value: list[str] | None) -> list[str] | None:
    if value is not None and value != ["text"]:
        raise PydanticCustomError("unsupported_parameter", 'only ["text"] is supported')
    return value


def _backend(value: str | None) -> str | None:
    if value not in (None, "auto", "xgrammar"):
        raise PydanticCustomError(
            "unsupported_parameter", 'only "auto" or "xgrammar" (the backend in use) is supported'
        )
    return value


# ``modalities``: only text output.
TextOnly = Annotated[list[Literal["text", "audio"]] | None, AfterValidator(_text_modality)]
# vLLM's ``guided_decoding_backend``: only the one that runs (the constraint is the same).
GrammarBackend = Annotated[str | None, AfterValidator(_backend)]


def _empty_suffix(value: str | None) -> str | None:
    if value:
        raise PydanticCustomError(
            "unsupported_parameter", "only an empty suffix is supported by tokenwire"
        )
    return value


# A text tokenwire does not use: only null or "" pass (``suffix``).
EmptyOnly = Annotated[str | None, AfterValidator(_empty_suffix)]
