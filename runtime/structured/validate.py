"""Front-side check that a request's constraint compiles, with the compiler's own message.

xgrammar parses a JSON schema, regex or EBNF grammar into a tokenizer-independent ``Grammar``
in about a millisecond; only that parse runs here (in the front, before anything reaches the
engine core), so a bad schema fails its call at once as a ``ParameterError`` naming the field.
The tokenizer-dependent compile happens later, in the core's compile pool. Recently accepted
constraints are remembered, so a repeated schema costs one dict lookup.
"""

from __future__ import annotations

import re
from collections import OrderedDict

from tokenwire.runtime.errors import ParameterError, clip
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.structured.params import FIELD, MAX_JSON_WHITESPACE, GrammarSpec

# xgrammar prefixes its messages with a time stamp, a source path and the failed check.
_PREFIX = re.compile(
    r"^\s*(\[[0-9:]+\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?(Check failed:.*?is false:\s*)?"
)
MAX_MESSAGE_CHARS = 512


def compiler_message(exc: BaseException) -> str:
    """The compiler's message without time stamp, source path or check text, clipped."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return clip(_PREFIX.sub("", text).strip(), MAX_MESSAGE_CHARS)


def parse_grammar(spec: GrammarSpec) -> None:
    """Raise xgrammar's error when ``spec`` does not parse (no tokenizer needed)."""
    import xgrammar as xgr

    if spec.kind == "json":
        xgr.Grammar.from_json_schema(
            spec.text,
            any_whitespace=spec.any_whitespace,
            max_whitespace_cnt=MAX_JSON_WHITESPACE if spec.any_whitespace else None,
        )
    elif spec.kind == "regex":
        xgr.Grammar.from_regex(spec.text)
    else:
        xgr.Grammar.from_ebnf(spec.text)


class StructuredValidator:
    """Checks ``SamplingParams.structured_outputs``; remembers the last ``capacity`` specs
    that parsed. ``has_tokenizer``: structured outputs need the model's tokenizer."""

    def __init__(self, has_tokenizer: bool, capacity: int = 256) -> None:
        self.has_tokenizer = has_tokenizer
        self.capacity = capacity
        self._ok: OrderedDict[GrammarSpec, None] = OrderedDict()

    def check(self, params: SamplingParams) -> None:
        constraint = params.structured_outputs
        if constraint is None:
            return
        if not self.has_tokenizer:
            raise ParameterError(FIELD, "this model has no tokenizer to constrain its output")
        spec = constraint.spec()
        if spec in self._ok:
            self._ok.move_to_end(spec)
            return
        try:
            parse_grammar(spec)
        except Exception as exc:  # xgrammar raises RuntimeError (and ValueError) on bad input
            raise ParameterError(f"{FIELD}.{constraint.kind}", compiler_message(exc)) from None
        self._ok[spec] = None
        if len(self._ok) > self.capacity:
            self._ok.popitem(last=False)
