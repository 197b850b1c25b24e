"""``OutputParsing``: how one request's choices are read (reasoning, tool calls), and the
per-choice ``ChoiceParser`` that does it incrementally.

Text flows through the reasoning parser first (its content goes on), then through the tool
parser chosen by the request's ``tool_choice``: the configured ``--tool-call-parser`` for
``auto``, the JSON-array reader for ``required``, the arguments reader for a named function.
A unary answer runs the very same code over the whole text, so streamed deltas concatenate
to the unary fields, with one exception: a ``required`` or named call that the grammar could
not finish (cut by ``max_tokens`` or a stop) is dropped from the unary answer (vLLM's
behaviour), while a stream has already sent its pieces (its finish reason says "length").
A streamed delta carries at most one piece per call (``ChoiceParser.step``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenwire.runtime.errors import ParameterError
from tokenwire.server.tool_parsers.deepseek import DeepSeekV3ToolParser
from tokenwire.server.tool_parsers.forced import JsonArrayToolParser, NamedToolParser
from tokenwire.server.tool_parsers.harmony import HarmonyParser
from tokenwire.server.tool_parsers.hermes import HermesToolParser
from tokenwire.server.tool_parsers.json_calls import (
    granite_parser,
    llama3_json_parser,
    mistral_parser,
)
from tokenwire.server.tool_parsers.pythonic import PythonicToolParser
from tokenwire.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from tokenwire.server.tool_parsers.reasoning import make_reasoning_parser
from tokenwire.server.tool_parsers.tool_choice import FunctionSpec, ToolMode
from tokenwire.server.tool_parsers.types import (
    IdFactory,
    ParsedDelta,
    ToolCallInfo,
    coalesce_pieces,
    merge_pieces,
    new_call_id,
)


class ToolParser(Protocol):
    """Also the shape of a reasoning parser (its ``feed`` / ``finish`` deltas carry
    ``reasoning`` and the ``content`` that goes on to the tool parser)."""

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


# name -> factory(new id, parallel tool calls, the request's tools)
TOOL_PARSERS: dict[str, Callable[[IdFactory, bool, Sequence[FunctionSpec]], ToolParser]] = {
    "hermes": lambda new_id, parallel, tools: HermesToolParser(new_id, parallel),
    "llama3_json": lambda new_id, parallel, tools: llama3_json_parser(new_id),
    "mistral": lambda new_id, parallel, tools: mistral_parser(new_id),
    "granite": lambda new_id, parallel, tools: granite_parser(new_id),
    "qwen3_coder": Qwen3CoderToolParser,
    "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV3ToolParser,
    "openai": HarmonyParser,  # gpt-oss (vLLM's name)
}
# Parsers that read special tokens of the output (its text is decoded with them kept).
HARMONY_TOOL_PARSERS = frozenset({"openai"})
HARMONY_REASONING_PARSERS = frozenset({"openai_gptoss"})
REASONING_PARSERS = ("qwen3", "deepseek_r1", *sorted(HARMONY_REASONING_PARSERS))


def needs_harmony(tool_call_parser: str | None, reasoning_parser: str | None) -> bool:
    """Whether the server reads gpt-oss Harmony (its encoding is loaded at startup)."""
    return tool_call_parser in HARMONY_TOOL_PARSERS or reasoning_parser in HARMONY_REASONING_PARSERS


__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ChoiceParser",
    "OutputParsing",
    "ParsedOutput",
    "needs_harmony",
]


def check_parser_names(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Startup check of the server flags (errors name the flag)."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(
            f"--tool-call-parser {tool_call_parser!r} is unknown: choose one of "
            f"{', '.join(TOOL_PARSERS)}"
        )
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser {reasoning_parser!r} is unknown: choose one of "
            f"{', '.join(REASONING_PARSERS)}"
        )


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str
    reasoning: str
    tool_calls: list[ToolCallInfo]


@dataclass(frozen=True, slots=True)
class OutputParsing:
    """``tool_mode`` None: the request has no tools (no tool parsing)."""

    reasoning_parser: str | None = None
    tool_mode: ToolMode | None = None
    tool_call_parser: str | None = None
    function: str | None = None  # tool_mode "named"
    parallel_tool_calls: bool = True
    tools: tuple[FunctionSpec, ...] = ()  # their schemas type XML parameters (qwen3_coder)

    def __post_init__(self) -> None:
        if self.tool_mode == "auto" and self.tool_call_parser is None:
            raise ParameterError(
                "tool_choice",
                '"auto" needs a server started with --tool-call-parser; ask for "required" '
                "or a named function instead",
            )

    @property
    def active(self) -> bool:
        return self.reasoning_parser is not None or self.tool_mode not in (None, "none")

    @property
    def _harmony_tools(self) -> bool:
        return self.tool_mode == "auto" and self.tool_call_parser in HARMONY_TOOL_PARSERS

    @property
    def needs_special_tokens(self) -> bool:
        """The output must be decoded with its special tokens (Harmony's markers)."""
        return self._harmony_tools or self.reasoning_parser in HARMONY_REASONING_PARSERS

    def new(self, new_id: IdFactory = new_call_id) -> ChoiceParser:
        reasoning: ToolParser | None = None
        if self.reasoning_parser in HARMONY_REASONING_PARSERS:
            if not self._harmony_tools:  # else the tool parser reads the channels itself
                reasoning = HarmonyParser(new_id, calls=False)
        elif self.reasoning_parser is not None:
            reasoning = make_reasoning_parser(self.reasoning_parser)
        tools: ToolParser | None = None
        if self.tool_mode == "auto":
            assert self.tool_call_parser is not None
            factory = TOOL_PARSERS[self.tool_call_parser]
            tools = factory(new_id, self.parallel_tool_calls, self.tools)
        elif self.tool_mode == "required":
            tools = JsonArrayToolParser(new_id, forced=True)
        elif self.tool_mode == "named":
            assert self.function is not None
            tools = NamedToolParser(self.function, new_id)
        return ChoiceParser(reasoning, tools)

    def parse(self, text: str, new_id: IdFactory = new_call_id) -> ParsedOutput:
        """A whole output at once (the unary answer)."""
        parser = self.new(new_id)
        delta = parser.feed(text)
        delta.extend(parser.finish())
        calls = merge_pieces(delta.tool_calls)
        forced = parser.tools
        if isinstance(forced, JsonArrayToolParser | NamedToolParser) and not forced.complete:
            calls = []  # the grammar's JSON was cut short (max_tokens, a stop): no call
        return ParsedOutput(delta.content, delta.reasoning, calls)


class ChoiceParser:
    def __init__(self, reasoning: ToolParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, text: str) -> ParsedDelta:
        if self.reasoning is None:
            return self._tools(ParsedDelta(content=text), final=False)
        return self._tools(self.reasoning.feed(text), final=False)

    def finish(self) -> ParsedDelta:
        tail = ParsedDelta() if self.reasoning is None else self.reasoning.finish()
        return self._tools(tail, final=True)

    def step(self, text: str, final: bool) -> ParsedDelta:
        """One output delta (``final``: the output ends with it) as one ``ParsedDelta`` with
        at most one tool-call piece per call, as a streamed chunk must carry it."""
        delta = self.feed(text)
        if final:
            delta.extend(self.finish())
        delta.tool_calls = coalesce_pieces(delta.tool_calls)
        return delta

    def _tools(self, delta: ParsedDelta, final: bool) -> ParsedDelta:
        if self.tools is None:
            return delta
        out = ParsedDelta(reasoning=delta.reasoning)
        if delta.content:
            out.extend(self.tools.feed(delta.content))
        if final:
            out.extend(self.tools.finish())
        return out
