"""Regression tests for schema bombs (defects item 2): a constraint that is costly to parse
must not stall the server's event loop. Every grammar kind, tool-derived schemas, the gRPC
and REST paths and the offline ``LLM``: size and depth limits are checked first, the parse
runs off the loop under a time limit, and the error names the parameter. Real server on
loopback (engine core in its own process), generated stubs, the real ``openai`` SDK.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from grammar_probes import (
    BOMB,
    HEALTH_BOUND_S,
    SMALL_GENERATE_BOUND_S,
    HealthProbe,
    chat_request,
    nested_arrays,
    small_generate,
)
from grpc_helpers import details_of
from rest_harness import RestHarness
from server_harness import MODEL_NAME, ServerHarness
from tiny_models import build_tiny_model

from tokenwire.runtime.errors import ParameterError
from tokenwire.runtime.llm import LLM
from tokenwire.runtime.sampling_params import SamplingParams
from tokenwire.runtime.structured.config import ConstraintLimits
from tokenwire.runtime.structured.params import StructuredOutputsParams
from tokenwire.v1 import common_pb2, generation_pb2_grpc

Code = grpc.StatusCode
# The front's time limit (the core's says "compiling the constraint took longer than").
FRONT_TIMEOUT = "checking the constraint took longer than"


def wide_and_deep() -> dict[str, Any]:
    """Inside the size and depth limits, yet seconds of parsing: 300 properties, each
    arrays 60 deep (~510 KB; ~4.5 s on one core)."""
    return {"type": "object", "properties": {f"p{i}": nested_arrays(60) for i in range(300)}}


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer: Any) -> Path:
    """The tiny model with the default tokenizer and an 8k context: a chat whose tools carry
    the bomb renders to ~4.5k prompt tokens (the template shows the schema)."""
    out = tmp_path_factory.mktemp("tiny-llama-8k")
    build_tiny_model(
        "llama",
        out,
        vocab_size=len(smollm_tokenizer),
        max_position_embeddings=8192,
    )
    smollm_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def harness_model(long_model: Path) -> Path:
    return long_model


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(max_model_len=8192, max_num_batched_tokens=8192)


def refused_beside_probes(
    harness: ServerHarness, send: Callable[[], Any]
) -> tuple[BaseException, HealthProbe, float]:
    """Run ``send`` (which must fail) in a thread while health is probed and an unrelated
    small Generate runs; the failure, the probe and the small Generate's seconds."""
    failure: list[BaseException] = []

    def go() -> None:
        try:
            send()
        except BaseException as exc:
            failure.append(exc)

    with HealthProbe(harness.target) as probe:
        thread = threading.Thread(target=go)
        thread.start()
        small = small_generate(harness.target)
        thread.join(120)
    slowest = max(probe.latencies, default=None)
    print(f"slowest health answer {slowest} s; small Generate {small:.3f} s")
    assert failure, "the bad request was accepted"
    return failure[0], probe, small


def assert_invalid(exc: BaseException, param: str, *words: str) -> None:
    assert isinstance(exc, grpc.RpcError), exc
    assert exc.code() == Code.INVALID_ARGUMENT, exc.details()
    info, _ = details_of(exc)
    assert info is not None and info.metadata["param"] == param, exc.details()
    for word in words:
        assert word in exc.details(), exc.details()


def test_schema_bomb_refused_while_health_and_generate_answer(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub
) -> None:
    """Before the fix the 450-deep schema was parsed on the event loop: health and an
    unrelated Generate waited seconds. Now it is refused by the depth limit."""
    request = chat_request(common_pb2.StructuredOutput(json_schema=BOMB))
    exc, probe, small = refused_beside_probes(harness, lambda: gen.Generate(request, timeout=60))
    assert_invalid(exc, "structured_output.json_schema", "deeper than")
    probe.assert_free()
    assert small < SMALL_GENERATE_BOUND_S, small
    harness.assert_idle()


def test_slow_constraint_within_limits_times_out_off_the_loop(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub
) -> None:
    """Inside the limits but seconds to parse: checked on a worker thread, refused at the
    (lowered) time limit; health and other requests never wait for it."""
    validator = harness.engine.frontend.structured
    saved = validator.limits
    validator.limits = ConstraintLimits(check_timeout=0.3)
    try:
        text = json.dumps(wide_and_deep())
        request = chat_request(common_pb2.StructuredOutput(json_schema=text))
        exc, probe, small = refused_beside_probes(
            harness, lambda: gen.Generate(request, timeout=60)
        )
        assert_invalid(exc, "structured_output.json_schema", FRONT_TIMEOUT)
        probe.assert_free()
        assert small < SMALL_GENERATE_BOUND_S, small
        # The same constraint again: remembered as too slow, refused the same way.
        with pytest.raises(grpc.RpcError) as again:
            gen.Generate(request, timeout=60)
        assert_invalid(again.value, "structured_output.json_schema", FRONT_TIMEOUT)
    finally:
        validator.limits = saved
    harness.assert_idle()


BIG = 1 << 20  # the default size limit of a constraint (characters)
OVERSIZED = [
    ("json_schema", common_pb2.StructuredOutput(json_schema=json.dumps({"enum": ["v" * BIG]}))),
    ("regex", common_pb2.StructuredOutput(regex="a" * (BIG + 1))),
    ("grammar", common_pb2.StructuredOutput(grammar='root ::= "' + "a" * BIG + '"')),
    (
        "choice",
        common_pb2.StructuredOutput(
            choice=common_pb2.ChoiceList(choices=[f"c{i:07d}" for i in range(BIG // 8)])
        ),
    ),
]


@pytest.mark.parametrize(("kind", "structured"), OVERSIZED, ids=[k for k, _ in OVERSIZED])
def test_every_kind_has_a_size_limit(
    harness: ServerHarness,
    gen: generation_pb2_grpc.GenerationServiceStub,
    kind: str,
    structured: common_pb2.StructuredOutput,
) -> None:
    with pytest.raises(grpc.RpcError) as bad:
        gen.Generate(chat_request(structured), timeout=60)
    assert_invalid(bad.value, f"structured_output.{kind}", "the server allows at most")
    harness.assert_idle()


def test_json_object_and_small_constraints_still_run(
    gen: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    for structured in (
        common_pb2.StructuredOutput(json_object=True),
        common_pb2.StructuredOutput(json_schema=json.dumps(nested_arrays(20))),
        common_pb2.StructuredOutput(regex="[ab]{3}"),
    ):
        reply = gen.Generate(chat_request(structured), timeout=60)
        assert reply.choices[0].text, structured


@pytest.mark.parametrize("mode", ["required", "named"])
def test_tool_schema_bomb_is_refused_naming_tools(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub, mode: str
) -> None:
    tool = common_pb2.Tool(
        function=common_pb2.FunctionDefinition(name="deep", parameters_json=BOMB)
    )
    choice = (
        common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED)
        if mode == "required"
        else common_pb2.ToolChoice(function_name="deep")
    )
    request = chat_request(tools=[tool], tool_choice=choice)
    exc, probe, small = refused_beside_probes(harness, lambda: gen.Generate(request, timeout=60))
    assert_invalid(exc, "tools", "deeper than")
    probe.assert_free()
    assert small < SMALL_GENERATE_BOUND_S, small
    harness.assert_idle()


def test_rest_schema_bomb_is_400_while_health_answers(harness: ServerHarness) -> None:
    rest = RestHarness(harness).start()
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "b", "schema": json.loads(BOMB)}}
        with openai.OpenAI(base_url=f"{rest.url}/v1", api_key="x", max_retries=0) as client:

            def send() -> Any:
                return client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=4,
                    response_format=fmt,  # type: ignore[arg-type]
                )

            exc, probe, small = refused_beside_probes(harness, send)
            t0 = time.perf_counter()
            assert httpx.get(f"{rest.url}/health", timeout=10).status_code == 200
            assert time.perf_counter() - t0 < HEALTH_BOUND_S
        assert isinstance(exc, openai.BadRequestError), exc
        assert exc.param == "response_format" and "deeper than" in exc.message, exc.message
        probe.assert_free()
        assert small < SMALL_GENERATE_BOUND_S, small
    finally:
        rest.stop()
    harness.assert_idle()


def test_offline_llm_refuses_bombs(tiny_model_with_tokenizer: Path) -> None:
    llm = LLM(str(tiny_model_with_tokenizer), device="cpu", max_model_len=256)
    bomb = SamplingParams(structured_outputs=StructuredOutputsParams(json=BOMB))
    with pytest.raises(ParameterError) as deep:
        llm.generate(["Hi"], bomb, use_tqdm=False)
    assert deep.value.param == "structured_outputs.json" and "deeper than" in str(deep.value)
    llm.frontend.structured.limits = ConstraintLimits(check_timeout=0.3)
    slow = SamplingParams(structured_outputs=StructuredOutputsParams(json=wide_and_deep()))
    with pytest.raises(ParameterError) as late:
        llm.generate(["Hi"], slow, use_tqdm=False)
    assert FRONT_TIMEOUT in str(late.value)
    assert not llm.engine.has_unfinished_requests()
    llm.shutdown()
