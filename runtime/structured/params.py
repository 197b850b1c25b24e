"""``StructuredOutputsParams``: one request's output constraint (vLLM-shaped).

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``json_object`` (any JSON
object), ``regex``, ``choice`` (one of a list of strings), ``grammar`` (EBNF / GBNF, root rule
``root``) or ``structural_tag`` (xgrammar's structural tag as a dict or its JSON text, either
shape of ``structural_tag.py``) is set. Every form reduces to a ``GrammarSpec`` — a kind plus
one text — which is what the compile cache is keyed on and what crosses to the engine core.
Checks here are structural (types, one kind set); whether a schema, regex, grammar or
structural tag *compiles* (a structural tag's shape included) is checked by
``structured.validate`` with xgrammar's parser, off the caller's thread, so the message is
the compiler's.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any, Literal

from tokenwire.runtime.errors import ParameterError

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
# The runtime's name of the SamplingParams field (servers rename it to their own field).
FIELD = "structured_outputs"
# ``json_object``: any JSON object (OpenAI's JSON mode), as a schema.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Longest run of whitespace allowed between JSON tokens (any-whitespace mode). Unbounded, a
# small model can pad with blank space until max_tokens; 20 still fits pretty-printed JSON
# ten levels deep (newline + 2 spaces a level).
MAX_JSON_WHITESPACE = 20


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What to compile: ``kind`` and its text (a schema's JSON, a regex, an EBNF grammar).

    ``choice`` becomes an EBNF alternation and ``json_object`` the schema of any object, so
    only four compile paths exist; ``any_whitespace`` applies to JSON kinds only.
    """

    kind: Literal["json", "regex", "grammar", "structural_tag"]
    text: str
    any_whitespace: bool = True


@dataclass(frozen=True)
class StructuredOutputsParams:
    """``disable_any_whitespace``: JSON with ``json.dumps`` separators only (vLLM's flag); by
    default whitespace is allowed between JSON tokens as in vLLM, but at most
    ``MAX_JSON_WHITESPACE`` characters in a row."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    structural_tag: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None and not isinstance(self.json, str):
            if not isinstance(self.json, dict):
                raise ParameterError(f"{FIELD}.json", "must be a JSON schema (object or text)")
            try:
                text = jsonlib.dumps(self.json, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise ParameterError(f"{FIELD}.json", f"is not valid JSON: {exc}") from None
            object.__setattr__(self, "json", text)
        if isinstance(self.structural_tag, dict):  # its shape is checked with the grammar
            try:
                text = jsonlib.dumps(self.structural_tag, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError, RecursionError) as exc:
                raise ParameterError(
                    f"{FIELD}.structural_tag", f"is not valid JSON: {exc}"
                ) from None
            object.__setattr__(self, "structural_tag", text)
        self._validate()

    def _validate(self) -> None:
        set_kinds = [
            k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k)
        ]
        if self.json_object:
            set_kinds.append("json_object")
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ParameterError(f"{FIELD}.{name}", "must be a non-empty string")
        if self.choice is not None:
            if not self.choice:
                raise ParameterError(f"{FIELD}.choice", "must list at least one string")
            for item in self.choice:
                if not isinstance(item, str) or not item:
                    raise ParameterError(
                        f"{FIELD}.choice", "every choice must be a non-empty string"
                    )
        if len(set_kinds) != 1:
            got = ", ".join(set_kinds) or "none"
            raise ParameterError(
                FIELD,
                "set exactly one of json, json_object, regex, choice, grammar or "
                f"structural_tag (got {got})",
            )

    @property
    def kind(self) -> GrammarKind:
        if self.json is not None:
            return "json"
        if self.regex is not None:
            return "regex"
        if self.choice is not None:
            return "choice"
        if self.grammar is not None:
            return "grammar"
        if self.structural_tag is not None:
            return "structural_tag"
        return "json_object"

    def spec(self) -> GrammarSpec:
        """The constraint as one compile key."""
        any_ws = not self.disable_any_whitespace
        kind = self.kind
        if kind == "json":
            assert isinstance(self.json, str)
            return GrammarSpec("json", self.json, any_ws)
        if kind == "json_object":
            return GrammarSpec("json", JSON_OBJECT_SCHEMA, any_ws)
        if kind == "regex":
            assert self.regex is not None
            return GrammarSpec("regex", self.regex)
        if kind == "choice":
            assert self.choice is not None
            return GrammarSpec("grammar", choice_grammar(self.choice))
        if kind == "structural_tag":
            assert isinstance(self.structural_tag, str)
            return GrammarSpec("structural_tag", self.structural_tag)
        assert self.grammar is not None
        return GrammarSpec("grammar", self.grammar)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF matching exactly one of ``choices`` (JSON string escapes are EBNF escapes)."""
    return "root ::= " + " | ".join(jsonlib.dumps(c, ensure_ascii=True) for c in choices)
