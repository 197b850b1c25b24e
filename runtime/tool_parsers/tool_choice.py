"""``tool_choice`` -> the output constraint that enforces it (vLLM's approach).

``required``: a JSON array of at least one ``{"name": <one of the tools>, "parameters": <its
schema>}`` (at most one when parallel calls are off). A named function: its parameters
schema itself. ``auto`` and ``none`` constrain nothing (``auto`` is parsed from the text).
A tool without parameters takes exactly ``{}``. Tool-call JSON is written with ``json.dumps``
separators, not any whitespace: a model cannot pad a call with endless blank space.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tokenwire.runtime.errors import ParameterError, clip
from tokenwire.runtime.structured.params import StructuredOutputsParams

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
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.name]},
                    "parameters": t.parameters or _NO_PARAMETERS,
                },
                "required": ["name", "parameters"],
            }
            for t in tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
