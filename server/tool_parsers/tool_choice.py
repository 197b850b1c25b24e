"""``tool_choice`` -> the output constraint that enforces it (vLLM's approach).

``required``: a JSON array of at least one ``{"name": <one of the tools>, "parameters": <its
schema>}`` (at most one when parallel calls are off). A tool schema with local refs
(``$defs``, ``definitions``, ``#``) is placed whole under the combined schema's ``$defs``
(``tool_<i>``) with its refs rewritten to point there, so same-named ``$defs`` of two tools
never meet. A named function: its parameters
schema itself. ``auto`` and ``none`` constrain nothing (``auto`` is parsed from the text).
A tool without parameters takes exactly ``{}``. Tool-call JSON is written with ``json.dumps``
separators, not any whitespace: a model cannot pad a call with endless blank space.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tokenwire.runtime.errors import ParameterError, clip
from tokenwire.runtime.sampling_params import StructuredOutputsParams

ToolMode = Literal["none", "auto", "required", "named"]
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """One tool: ``parameters`` is its JSON schema (None: takes no parameters)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool = False

    def openai(self) -> dict[str, Any]:
        """The tool as chat templates expect it (OpenAI's tool object)."""
        function: dict[str, Any] = {"name": self.name, "description": self.description}
        function["parameters"] = self.parameters if self.parameters is not None else _NO_PARAMETERS
        return {"type": "function", "function": function}


def parse_parameters(param: str, text: str) -> dict[str, Any] | None:
    """A tool's parameters JSON text -> its schema (empty text: None)."""
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ParameterError(param, f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ParameterError(param, "must be a JSON schema object")
    return value


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: ToolMode
    function: str | None = None  # mode "named"

    def check(self, tools: list[FunctionSpec], param: str) -> None:
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ParameterError("tools", "function names must be unique")
        if self.mode in ("required", "named") and not tools:
            raise ParameterError(param, f"{self.mode!r} needs at least one tool")
        if self.mode == "named" and self.function not in names:
            raise ParameterError(param, f"no tool is named {clip(self.function)!r}")

    def constraint(
        self, tools: list[FunctionSpec], parallel: bool
    ) -> StructuredOutputsParams | None:
        """The grammar that enforces this choice; None for ``auto`` and ``none``."""
        if self.mode == "named":
            tool = next(t for t in tools if t.name == self.function)
            return StructuredOutputsParams(
                json=tool.parameters or _NO_PARAMETERS, disable_any_whitespace=True
            )
        if self.mode != "required":
            return None
        calls, defs = [], {}
        for i, tool in enumerate(tools):
            parameters = tool.parameters or _NO_PARAMETERS
            if _has_local_ref(parameters):
                # Its refs point into its own document: it moves whole under the combined
                # schema's ``$defs`` and every local ref gets that place as its prefix.
                key = f"tool_{i}"
                defs[key] = _prefix_refs(parameters, f"#/$defs/{key}")
                parameters = {"$ref": f"#/$defs/{key}"}
            calls.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [tool.name]},
                        "parameters": parameters,
                    },
                    "required": ["name", "parameters"],
                }
            )
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


# Keywords whose values are data, not subschemas: a "$ref" key inside them is not a ref;
# and keywords whose values map names to subschemas (a name there is not a keyword).
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def _is_pointer(ref: Any) -> bool:
    """A JSON-pointer ref into the same document (``#`` or ``#/...``; not an anchor)."""
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def _has_local_ref(schema: Any, names: bool = False) -> bool:
    """Whether ``schema`` holds a local ref (the same walk as ``_prefix_refs``)."""
    if isinstance(schema, list):
        return any(_has_local_ref(v) for v in schema)
    if not isinstance(schema, dict):
        return False
    for key, value in schema.items():
        if names:
            found = _has_local_ref(value)
        elif key == "$ref":
            found = _is_pointer(value)
        else:
            found = key not in _DATA_KEYWORDS and _has_local_ref(value, key in _SCHEMA_MAPS)
        if found:
            return True
    return False


def _prefix_refs(schema: Any, base: str, names: bool = False) -> Any:
    """``schema`` with every local ref (``#``, ``#/$defs/X``, ``#/properties/y``, ...) made
    relative to ``base``, the place the schema moves to; other values as they are.
    ``names``: ``schema`` maps names to subschemas (the value of ``properties``, ...)."""
    if isinstance(schema, list):
        return [_prefix_refs(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if names:
            out[key] = _prefix_refs(value, base)
        elif key == "$ref" and _is_pointer(value):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _prefix_refs(value, base, names=key in _SCHEMA_MAPS)
    return out
