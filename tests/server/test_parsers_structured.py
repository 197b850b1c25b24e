"""Structural tags and constrained ``tool_choice: "auto"`` served for real: a gRPC server
(engine core in its own process) and the REST shim driven by the official ``openai`` SDK.

The tiny random model has the default model's vocabulary plus ``<tool_call>`` and
``</tool_call>`` as tokens of their own, so a logit bias on ``<tool_call>`` makes the model
open a call (or a structure) at once; from there only the grammar shapes the output, and
the output must match the structure: a schema-valid JSON object between the tags.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from grpc_helpers import details_of
from server_harness import MODEL_NAME, ServerHarness
from tiny_models import build_tiny_model

from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Forecast", "parameters": SCHEMA},
}
LEGACY = {
    "type": "structural_tag",
    "structures": [{"begin": "<tool_call>", "schema": SCHEMA, "end": "</tool_call>"}],
    "triggers": ["<tool_call>"],
}
ANSWER_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<answer>",
        "content": {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 1},
        "end": "</answer>",
    },
}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any) -> Path:
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-llama-tool-tokens")
    smollm_tokenizer.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.save_pretrained(out)
    build_tiny_model("llama", out, vocab_size=len(tokenizer))
    return out


@pytest.fixture(scope="module")
def tool_token(model_dir: Path) -> int:
    from transformers import AutoTokenizer

    token = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<tool_call>")
    assert isinstance(token, int) and token >= 49152
    return token


@pytest.fixture(scope="module")
def harness_model(model_dir: Path) -> Path:
    return model_dir


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=512, tool_call_parser="hermes")


def grpc_request(
    structural_tag: str | None = None, bias: dict[int, float] | None = None, **chat: Any
) -> generation_pb2.GenerateRequest:
    output = common_pb2.OutputOptions()
    if structural_tag is not None:
        output.structured_output.structural_tag = structural_tag
    return generation_pb2.GenerateRequest(
        chat=common_pb2.ChatInput(
            messages=[common_pb2.ChatMessage(role="user", content=ASK[0]["content"])], **chat
        ),
        sampling=common_pb2.SamplingOptions(temperature=1.0, seed=5, logit_bias=bias or {}),
        stopping=common_pb2.StoppingOptions(max_tokens=160),
        output=output,
    )


def check_tagged(text: str, begin: str, end: str) -> int:
    """``text`` opens with ``begin`` and each ``begin`` starts a JSON object valid under
    SCHEMA closed by ``end`` (the last may be cut short); returns how many are complete."""
    assert text.startswith(begin), text
    parts = text.split(begin)[1:]
    for n, part in enumerate(parts):
        if end not in part:
            assert n == len(parts) - 1, text  # only the last may be open (max_tokens)
            continue
        body, _ = part.split(end, 1)  # then free text (no trigger) until the next one
        jsonschema.validate(json.loads(body), SCHEMA)
    complete = sum(end in part for part in parts)
    assert complete >= 1, text
    return complete


# ---------------------------------------------------------------------------- gRPC
def test_grpc_structural_tag_formats(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub, tool_token: int
) -> None:
    unary = gen.Generate(grpc_request(json.dumps(ANSWER_TAG))).choices[0]
    match = re.fullmatch(r"<answer>(.*)</answer>", unary.text, re.S)
    assert match is not None, unary.text
    jsonschema.validate(json.loads(match.group(1)), SCHEMA)
    assert unary.finish_reason == common_pb2.FINISH_REASON_EOS
    streamed = "".join(
        e.delta.text for e in gen.GenerateStream(grpc_request(json.dumps(ANSWER_TAG)))
    )
    assert streamed == unary.text  # seeded: the same answer
    # vLLM's legacy shape: free text until the trigger; the bias makes the model open it.
    legacy = gen.Generate(grpc_request(json.dumps(LEGACY), {tool_token: 100.0})).choices[0]
    check_tagged(legacy.text, "<tool_call>", "</tool_call>")
    harness.assert_idle()


@pytest.mark.parametrize(
    ("tag", "words"),
    [
        ("not json", "is not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"format": {"type": "nope"}}', "nope"),
        (
            json.dumps({**LEGACY, "structures": [{"begin": "<x>", "end": "</x>"}]}),
            "structures[0].begin must start with one of the triggers",
        ),
        (json.dumps({**LEGACY, "triggers": []}), "triggers must list at least one trigger"),
    ],
)
def test_grpc_bad_structural_tag_is_invalid_argument(
    gen: generation_pb2_grpc.GenerationServiceStub, tag: str, words: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        gen.Generate(grpc_request(tag))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info, _ = details_of(err.value)
    assert info is not None and info.metadata["param"] == "structured_output.structural_tag"
    assert words in (err.value.details() or ""), err.value.details()


def test_grpc_structural_tag_depth_limit(gen: generation_pb2_grpc.GenerationServiceStub) -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(70):
        deep = {"type": "object", "properties": {"a": deep}}
    content = {"type": "json_schema", "json_schema": deep}
    tag = {"type": "structural_tag", "format": {**ANSWER_TAG["format"], "content": content}}
    with pytest.raises(grpc.RpcError) as err:
        gen.Generate(grpc_request(json.dumps(tag)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nests deeper than 64" in (err.value.details() or "")
    info, _ = details_of(err.value)
    assert info is not None and info.metadata["param"] == "structured_output.structural_tag"


def test_grpc_auto_tool_choice_constrains_the_call(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub, tool_token: int
) -> None:
    tool = common_pb2.Tool(
        function=common_pb2.FunctionDefinition(
            name="get_weather", parameters_json=json.dumps(SCHEMA)
        )
    )
    request = grpc_request(bias={tool_token: 100.0}, tools=[tool], parallel_tool_calls=False)
    choice = gen.Generate(request).choices[0]
    (call,) = choice.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert choice.finish_reason == common_pb2.FINISH_REASON_EOS  # one call, then the end
    pieces = [p for e in gen.GenerateStream(request) for p in e.delta.tool_calls]
    assert "".join(p.arguments for p in pieces) == call.function.arguments
    assert [p.name for p in pieces if p.name] == ["get_weather"]
    harness.assert_idle()


# ---------------------------------------------------------------------------- REST
def chat(openai_client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 160)
    return openai_client.chat.completions.create(model=MODEL_NAME, seed=5, **kwargs)


def test_rest_structural_tag_shapes(
    harness: ServerHarness, openai_client: openai.OpenAI, tool_token: int
) -> None:
    reply = chat(openai_client, response_format=ANSWER_TAG)
    text = reply.choices[0].message.content
    match = re.fullmatch(r"<answer>(.*)</answer>", text, re.S)
    assert match is not None, text
    jsonschema.validate(json.loads(match.group(1)), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"
    bias = {str(tool_token): 100}
    legacy = chat(openai_client, response_format=LEGACY, logit_bias=bias)
    check_tagged(legacy.choices[0].message.content, "<tool_call>", "</tool_call>")
    streamed = chat(openai_client, response_format=LEGACY, logit_bias=bias, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == legacy.choices[0].message.content
    for extra in (
        {"structured_outputs": {"structural_tag": LEGACY}},
        {"structural_tag": json.dumps(LEGACY)},
    ):
        other = chat(openai_client, logit_bias=bias, extra_body=extra)
        assert other.choices[0].message.content == legacy.choices[0].message.content
    harness.assert_idle()


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {"response_format": {**LEGACY, "structures": [{"begin": "<tool_call>", "end": 1}]}},
            "response_format",
            "structures[0].end must be a string",
        ),
        ({"response_format": {**LEGACY, "triggers": []}}, "response_format", "triggers"),
        (
            {"response_format": {**LEGACY, "structures": [{"begin": "<a>", "end": "</a>"}]}},
            "response_format",
            "structures[0].begin",
        ),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
            "response_format",
            "nope",
        ),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "format"),
        ({"structured_outputs": {"structural_tag": "{"}}, "structured_outputs.structural_tag", ""),
        ({"structural_tag": "{}"}, "structural_tag", "format"),
        ({"structural_tag": json.dumps(LEGACY), "guided_regex": "a"}, "structural_tag", "only one"),
    ],
)
def test_rest_bad_structural_tag_is_400_naming_the_field(
    openai_client: openai.OpenAI, extra: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        chat(openai_client, extra_body=extra)
    assert bad.value.param == param, bad.value.message
    body = bad.value.body
    message = body.get("message", "") if isinstance(body, dict) else ""
    assert words in message and param in message, message


def test_rest_auto_tool_choice_constrains_the_call(
    harness: ServerHarness, openai_client: openai.OpenAI, tool_token: int
) -> None:
    kwargs: dict[str, Any] = {
        "tools": [WEATHER],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "logit_bias": {str(tool_token): 100},
    }
    reply = chat(openai_client, **kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    streamed = chat(openai_client, stream=True, **kwargs)
    names, args, finish = [], "", None
    for chunk in streamed:
        if not chunk.choices:
            continue
        for piece in chunk.choices[0].delta.tool_calls or ():
            names += [piece.function.name] if piece.function.name else []
            args += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (names, args, finish) == (["get_weather"], call.function.arguments, "tool_calls")
    # No bias: the model writes text; the constraint leaves it free (no call opened).
    plain = chat(openai_client, tools=[WEATHER], max_tokens=12)
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason in ("stop", "length")
    harness.assert_idle()
