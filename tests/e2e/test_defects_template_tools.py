"""Defects #17: without ``--tool-call-parser`` the server reads tool calls with the parser its
chat template implies (the default model's: ``hermes``, the format tokenwire renders tools
in for a template without tools), says so in the startup line, and ``tool_choice: "auto"``
(LangChain ``bind_tools``, openai-agents, plain SDK tool calls) answers 200. An explicit flag
wins; a template whose tool format is unknown keeps the 400 naming ``tool_choice``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from rest_harness import RestHarness
from serve_process import serve
from server_harness import MODEL_NAME, ServerHarness

from tokenwire.server.tool_parsers.detect import parser_for_template

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
# What a Hermes-format model writes for a call (the grammar makes the tiny model write it).
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'

QWEN25 = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools>\nFor each function call, return a json object within <tool_call>"
    "</tool_call> XML tags{%- endif %}"
)
MISTRAL = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
MISTRAL += "{%- for m in messages %}{%- if m.tool_calls %}[TOOL_CALLS]{%- endif %}{% endfor %}"
LLAMA31 = (
    "{%- if tools %}Given the following functions, please respond with a JSON for a function "
    'call with its proper arguments.{"name": function name, "parameters": ...}{%- endif %}'
    "{%- if builtin_tools %}<|python_tag|>{%- endif %}"
)
QWEN3_CODER = "{%- if tools %}<tools>{{ tools }}</tools><tool_call>\n<function=x>{%- endif %}"
GEMMA_LIKE = "{%- if tools %}Call tools as ```tool_code\nname(args)```: {{ tools }}{%- endif %}"


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        (QWEN25, "hermes"),
        (MISTRAL, "mistral"),
        (LLAMA31, "llama3_json"),
        ({"default": "{{ messages }}", "tool_use": QWEN25}, "hermes"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),  # tokenwire's Hermes
        (QWEN3_CODER, "qwen3_coder"),  # XML calls inside <tool_call>
        (GEMMA_LIKE, None),
        (None, None),
    ],
)
def test_parser_for_template(template: Any, parser: str | None) -> None:
    assert parser_for_template(template) == parser


def test_the_default_models_template_is_hermes(smollm_tokenizer: Any) -> None:
    assert parser_for_template(smollm_tokenizer.chat_template) == "hermes"


# ---------------------------------------------------------------------------- served
def test_default_serve_answers_tool_choice_auto(tiny_model_with_tokenizer: Path) -> None:
    """A real ``tokenwire serve`` (no --tool-call-parser) and the real openai SDK."""
    served = serve(tiny_model_with_tokenizer)
    try:
        startup = next(line for line in served.lines if "serving model=" in line)
        assert "tool_call_parser=hermes (from the chat template)" in startup
        fields = json.loads(startup)
        assert (fields["tool_call_parser"], fields["tool_call_parser_source"]) == (
            "hermes",
            "chat_template",
        )
        with openai.OpenAI(base_url=f"{served.rest_url}/v1", api_key="x", max_retries=0) as sdk:
            model = sdk.models.list().data[0].id
            plain = sdk.chat.completions.create(
                model=model, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=8
            )
            assert plain.choices[0].finish_reason in ("stop", "length", "tool_calls")
            called = sdk.chat.completions.create(
                model=model,
                messages=ASK,
                tools=[WEATHER],
                tool_choice="auto",
                max_tokens=64,
                extra_body={"guided_choice": [HERMES_CALL]},
            )
        message = called.choices[0].message
        assert called.choices[0].finish_reason == "tool_calls"
        assert message.tool_calls is not None
        assert [
            (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls
        ] == [("get_weather", {"city": "Oslo"})]
    finally:
        served.proc.terminate()
        assert served.proc.wait(timeout=60) == 0


def _sdk(harness: ServerHarness) -> tuple[RestHarness, openai.OpenAI]:
    rest = RestHarness(harness).start()
    return rest, openai.OpenAI(base_url=f"{rest.url}/v1", api_key="x", max_retries=0)


@pytest.fixture
def explicit(tiny_model_with_tokenizer: Path) -> Iterator[ServerHarness]:
    h = ServerHarness(tiny_model_with_tokenizer, in_process=True, tool_call_parser="llama3_json")
    yield h.start()
    h.stop()


def test_an_explicit_parser_wins(explicit: ServerHarness) -> None:
    assert explicit.server.tool_call_parser == "llama3_json"
    rest, sdk = _sdk(explicit)
    try:
        reply = sdk.chat.completions.create(
            model=MODEL_NAME,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="auto",
            max_tokens=64,
            extra_body={"guided_choice": [HERMES_CALL]},
        )
    finally:
        sdk.close()
        rest.stop()
    # llama3_json does not read Hermes tags: the text stays content.
    assert reply.choices[0].message.tool_calls in (None, [])
    assert reply.choices[0].message.content == HERMES_CALL


@pytest.fixture
def unknown(tiny_model_with_tokenizer: Path) -> Iterator[ServerHarness]:
    h = ServerHarness(tiny_model_with_tokenizer, in_process=True)
    template = GEMMA_LIKE + "{% for m in messages %}{{ m.content }}{% endfor %}"
    model = dataclasses.replace(h.config.model, chat_template=template)
    h.config = dataclasses.replace(h.config, model=model)
    yield h.start()
    h.stop()


def test_an_unknown_tool_format_keeps_the_400(unknown: ServerHarness) -> None:
    assert unknown.server.tool_call_parser is None
    rest, sdk = _sdk(unknown)
    try:
        with pytest.raises(openai.BadRequestError) as err:
            sdk.chat.completions.create(
                model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=4
            )
    finally:
        sdk.close()
        rest.stop()
    assert err.value.param == "tool_choice"
    assert "--tool-call-parser" in err.value.message
