"""What each registered parser reads, for the ``--tool-call-parser`` and
``--reasoning-parser`` help (built from the registries, so a new parser needs a line here)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from tokenwire.server.tool_parsers.output import REASONING_PARSERS, TOOL_PARSERS

TOOL_PARSER_FORMATS: Mapping[str, str] = MappingProxyType(
    {
        "hermes": "<tool_call>{JSON}</tool_call> (Hermes, Qwen2.5/Qwen3, SmolLM2)",
        "llama3_json": "<|python_tag|> or a bare JSON object, calls split by ; (Llama 3.x)",
        "mistral": "[TOOL_CALLS] and a JSON array (Mistral)",
        "granite": "<|tool_call|> and a JSON array (Granite 3.x)",
        "qwen3_coder": "<tool_call><function=NAME><parameter=...> XML (Qwen3-Coder)",
        "pythonic": "a Python list of calls, [f(x=1), g()] (Llama 3.2)",
        "llama4_pythonic": "the pythonic list, optionally in <|python_start|> (Llama 4)",
        "deepseek_v3": "DeepSeek-V3 / R1-0528 tool-call tokens with a json fence (V3.1's too)",
        "deepseek_v31": "DeepSeek-V3.1 tool-call tokens, no fence (V3's too)",
        "openai": "gpt-oss Harmony messages to functions.NAME",
    }
)
REASONING_PARSER_FORMATS: Mapping[str, str] = MappingProxyType(
    {
        "qwen3": "<think>...</think> when the output opens with <think> (Qwen3)",
        "deepseek_r1": "the output starts in reasoning, up to </think> (DeepSeek-R1)",
        "openai_gptoss": "gpt-oss Harmony's analysis channel",
    }
)


def describe(names: Iterable[str], formats: Mapping[str, str]) -> str:
    """``name: format; ...`` for each registered name (a KeyError names one not described)."""
    return "; ".join(f"{name}: {formats[name]}" for name in names)


def tool_parser_help() -> str:
    return describe(TOOL_PARSERS, TOOL_PARSER_FORMATS)


def reasoning_parser_help() -> str:
    return describe(REASONING_PARSERS, REASONING_PARSER_FORMATS)
