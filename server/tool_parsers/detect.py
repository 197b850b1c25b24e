"""The tool-call parser a model's chat template implies, for a server started without
``--tool-call-parser`` (an explicit flag always wins).

A template that does not take tools (SmolLM2's, the default model's) gets the tools written
into the conversation in the Hermes format by tokenwire itself (``chat.py``), so its calls
come back as ``<tool_call>`` JSON: ``hermes``. A template that takes tools is recognised by
a marker only its format uses, checked in this order: gpt-oss's Harmony ``<|channel|>`` ->
``openai``; DeepSeek's ``<｜tool▁calls▁begin｜>`` -> ``deepseek_v3`` (V3 and V3.1 alike);
Qwen3-Coder's ``<function=`` XML -> ``qwen3_coder``; Granite's ``<|tool_call|>`` ->
``granite``; ``[TOOL_CALLS]`` (Mistral) -> ``mistral``; Llama 4's pythonic instruction
``[func_name1(`` -> ``pythonic``; Llama 3.1+'s ``<|python_tag|>`` or its "JSON for a
function call" instruction -> ``llama3_json``; ``<tool_call>`` JSON (Qwen2.5, Qwen3, Hermes)
-> ``hermes``. Any other format (Gemma, ...) is unknown: None, and ``tool_choice: "auto"``
keeps asking for ``--tool-call-parser``.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenwire.server.tool_parsers.chat import template_knows_tools

# (marker in the template, the parser of that format), checked in this order.
_FORMATS = (
    ("<|channel|>", "openai"),
    ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
    ("<function=", "qwen3_coder"),
    ("<|tool_call|>", "granite"),
    ("[TOOL_CALLS]", "mistral"),
    ("[func_name1(", "pythonic"),
    ("<|python_tag|>", "llama3_json"),
    ("JSON for a function call", "llama3_json"),
    ("<tool_call>", "hermes"),
)


def parser_for_template(template: str | Mapping[str, str] | None) -> str | None:
    """The ``--tool-call-parser`` name for chats rendered with ``template``; None: unknown
    (or no template at all, so no chat)."""
    if not template:
        return None
    if not template_knows_tools(template):
        return "hermes"  # tokenwire renders the tools and calls in the Hermes format
    text = template if isinstance(template, str) else "\n".join(template.values())
    return next((parser for marker, parser in _FORMATS if marker in text), None)
