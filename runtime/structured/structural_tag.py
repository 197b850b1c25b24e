"""Structural tags (xgrammar's ``structural_tag``): free text with constrained regions.

Two shapes are accepted, as vLLM accepts them:

- the legacy one, ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``:
  any text until one of the ``triggers`` appears, then one of the structures whose ``begin``
  starts with that trigger, its ``schema`` (a JSON schema) and its ``end``, then free text
  again (xgrammar's ``triggered_tags``);
- xgrammar's current one, ``{"type": "structural_tag", "format": {...}}`` (any of its formats:
  ``triggered_tags``, ``tag``, ``sequence``, ``json_schema``, ...).

Both become the current shape's JSON text (``normalize``) where the grammar work runs: the
front's check on its worker threads and the core's compile pool, after the limits of
``limits.py`` (never on an event loop: the document is parsed here). The checks are
structural and name the failing part (``structures[0].begin``, see ``problem``); whether
the format itself is valid is xgrammar's parse. A ``json_schema`` region gets the whitespace
bound of every JSON constraint unless it sets its own. Pure Python: no xgrammar here.
"""

from __future__ import annotations

import json
from typing import Any

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.structured.params import MAX_JSON_WHITESPACE

TYPE = "structural_tag"
_ROOT = "structural_tag"


def canonical(text: str) -> str:
    """``text`` in the current shape; raises ``ValueError`` with ``problem``'s message."""
    try:
        return normalize(text, _ROOT)
    except ParameterError as exc:
        raise ValueError(problem(exc)) from None


def problem(exc: ParameterError) -> str:
    """The message of a shape error, led by the part it names (``structures[0].begin ...``)."""
    message = str(exc).removeprefix(f"{exc.param}: ")
    part = exc.param.removeprefix(_ROOT).lstrip(".")
    return f"{part} {message}" if part else message


def normalize(value: str | dict[str, Any], param: str) -> str:
    """``value`` (a dict or its JSON text, either shape) -> the current shape as JSON text.
    Raises ``ParameterError`` naming ``param`` (and the part) for a bad shape."""
    document = _document(value, param)
    if "structures" in document or "triggers" in document:
        document = _from_legacy(document, param)
    elif "format" not in document:
        raise ParameterError(param, 'needs "format" (or the legacy "structures" and "triggers")')
    elif not isinstance(document["format"], dict):
        raise ParameterError(f"{param}.format", "must be an object")
    else:
        kind = document.get("type", TYPE)
        if kind != TYPE:
            raise ParameterError(f"{param}.type", f'must be "{TYPE}"')
        extra = sorted(set(document) - {"type", "format"})
        if extra:
            raise ParameterError(param, f"unknown field {extra[0]!r}")
        document = {"type": TYPE, "format": document["format"]}
    _bound_whitespace(document["format"])
    try:
        return json.dumps(document, ensure_ascii=False, allow_nan=False)
    except RecursionError:
        raise ParameterError(param, "nests too deep") from None
    except (TypeError, ValueError) as exc:
        raise ParameterError(param, f"is not valid JSON: {exc}") from None


def _bound_whitespace(node: Any) -> None:
    """Every ``json_schema`` format without its own ``max_whitespace_cnt`` gets the bound
    of every JSON constraint (``MAX_JSON_WHITESPACE``; else a random or small model can pad
    with blank space until ``max_tokens``). Schemas themselves are not entered."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if item.get("type") == "json_schema" and "json_schema" in item:
                item.setdefault("max_whitespace_cnt", MAX_JSON_WHITESPACE)
                stack.extend(v for k, v in item.items() if k != "json_schema")
            else:
                stack.extend(item.values())


def _document(value: str | dict[str, Any], param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:
            raise ParameterError(param, "nests too deep") from None
        except ValueError as exc:
            raise ParameterError(param, f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ParameterError(param, "must be a JSON object")
    return value


def _from_legacy(document: dict[str, Any], param: str) -> dict[str, Any]:
    structures, triggers = document.get("structures"), document.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ParameterError(f"{param}.structures", "must list at least one structure")
    if not isinstance(triggers, list) or not triggers:
        raise ParameterError(f"{param}.triggers", "must list at least one trigger")
    for i, trigger in enumerate(triggers):
        if not isinstance(trigger, str) or not trigger:
            raise ParameterError(f"{param}.triggers[{i}]", "must be a non-empty string")
    extra = sorted(set(document) - {"type", "structures", "triggers"})
    if extra:
        raise ParameterError(param, f"unknown field {extra[0]!r}")
    if document.get("type", TYPE) != TYPE:
        raise ParameterError(f"{param}.type", f'must be "{TYPE}"')
    tags = [_legacy_tag(s, f"{param}.structures[{i}]", triggers) for i, s in enumerate(structures)]
    fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    return {"type": TYPE, "format": fmt}


def _legacy_tag(structure: Any, param: str, triggers: list[str]) -> dict[str, Any]:
    if not isinstance(structure, dict):
        raise ParameterError(param, "must be an object with begin, schema and end")
    extra = sorted(set(structure) - {"begin", "schema", "end"})
    if extra:
        raise ParameterError(param, f"unknown field {extra[0]!r}")
    for key in ("begin", "end"):
        if not isinstance(structure.get(key), str):
            raise ParameterError(f"{param}.{key}", "must be a string")
    begin = structure["begin"]
    if not begin or not any(begin.startswith(t) for t in triggers):
        raise ParameterError(f"{param}.begin", "must start with one of the triggers")
    schema = structure.get("schema", True)
    if isinstance(schema, str):
        schema = _document(schema, f"{param}.schema")
    if not isinstance(schema, dict | bool):
        raise ParameterError(f"{param}.schema", "must be a JSON schema (object or boolean)")
    content = {"type": "json_schema", "json_schema": schema}
    return {"type": "tag", "begin": begin, "content": content, "end": structure["end"]}
