"""The building blocks of the REST shim's request bodies (``models``, ``embeddings``,
``tokenize``, ``responses_api.models``): the strict, frozen pydantic base ``_Strict``, the
integer types range-checked to their proto fields (uint32, int32, uint64; non-empty token-id
lists), ``logit_bias``'s token-id keys, and ``_bad_text_path``, which finds a string that is
not valid Unicode (a lone UTF-16 surrogate, which protobuf cannot encode) anywhere in a value.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from tokenwire.server.rest.errors import NOT_UNICODE, clip

U32_MAX = 2**32 - 1
U32 = Annotated[int, Field(ge=0, le=U32_MAX)]
I32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
U64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
NonEmptyIds = Annotated[list[U32], Field(min_length=1)]


def _logit_bias(value: dict[str, float] | None) -> dict[str, float] | None:
    for key in value or {}:
        if not key.isdigit() or int(key) > U32_MAX:
            raise PydanticCustomError(
                "invalid_value",
                "keys must be token ids (decimal strings), got {key}",
                {"key": clip(key)},
            )
    return value


LogitBias = Annotated[dict[str, float] | None, AfterValidator(_logit_bias)]


def _is_text(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _bad_text_path(value: Any) -> tuple[str | int, ...] | None:
    """Where in ``value`` (nested models, lists, dicts) a string that is not valid Unicode
    sits: ``()`` for ``value`` itself, ``None`` when there is none."""
    if isinstance(value, str):
        return None if _is_text(value) else ()
    items: Any
    if isinstance(value, BaseModel):
        items = ((name, getattr(value, name)) for name in type(value).model_fields)
    elif isinstance(value, dict):
        for key in value:
            if isinstance(key, str) and not _is_text(key):
                return (key,)
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        path = _bad_text_path(item)
        if path is not None:
            return (key, *path)
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class _TextBody(_Strict):
    """A body whose every field (strings all the way down) must be valid Unicode: a 400
    naming the field otherwise."""

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if _bad_text_path(value) is not None:
            raise PydanticCustomError("invalid_unicode", NOT_UNICODE, {"path": ()})
        return value
