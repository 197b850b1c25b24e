"""The gRPC API through generated stubs: Generate / GenerateStream agreement, stream event
order, request ids, n > 1, logprobs, ModelService, health and reflection.

The tiny model has no tokenizer, so requests use ``token_ids``; text/chat input and
Tokenize/Detokenize fail with INVALID_ARGUMENT here, and the real tokenizer round trip runs
against the default model in a slow test.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import delta_ids, details_of, greedy_request
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_harness import MODEL_NAME, ServerHarness

from tokenwire.server.grpc.server import GrpcServer, GrpcSettings
from tokenwire.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    models_pb2,
    models_pb2_grpc,
)

PROMPT = [5, 17, 33, 101, 250, 7, 64, 300, 12]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def request(
    ids: list[int] = PROMPT, max_tokens: int = 12, request_id: str = "", **sampling: Any
) -> generation_pb2.GenerateRequest:
    return greedy_request(ids, max_tokens, request_id, **sampling)


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    info, _ = details_of(err)
    assert info is not None, "no ErrorInfo detail"
    return info


@pytest.fixture(scope="module")
def models(channel: grpc.Channel) -> models_pb2_grpc.ModelServiceStub:
    return models_pb2_grpc.ModelServiceStub(channel)


def events_of(events: list[generation_pb2.GenerateStreamResponse]) -> list[str]:
    return [e.WhichOneof("event") for e in events]


# ---------------------------------------------------------------------------- generation
def test_stream_equals_unary_and_has_the_event_structure(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub
) -> None:
    unary = gen.Generate(request(request_id="api-unary"))
    assert unary.request_id == "api-unary" and unary.model == MODEL_NAME
    [choice] = unary.choices
    assert len(choice.token_ids) == 12
    assert choice.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (unary.usage.prompt_tokens, unary.usage.completion_tokens) == (len(PROMPT), 12)

    call = gen.GenerateStream(request(request_id="api-stream"))
    events = list(call)
    assert dict(call.initial_metadata())["x-request-id"] == "api-stream"
    kinds = events_of(events)
    assert kinds[0] == "start" and kinds[-1] == "usage"
    assert kinds.count("start") == 1 and kinds.count("usage") == 1
    assert kinds.count("end") == 1 and kinds.index("end") > max(
        i for i, k in enumerate(kinds) if k == "delta"
    )
    start = events[0].start
    assert (start.request_id, start.model, start.prompt_tokens) == (
        "api-stream",
        MODEL_NAME,
        len(PROMPT),
    )
    assert delta_ids(events) == list(choice.token_ids)
    end = events[kinds.index("end")].end
    assert (end.index, end.finish_reason, end.completion_tokens) == (
        0,
        common_pb2.FINISH_REASON_LENGTH,
        12,
    )
    assert events[-1].usage == unary.usage
    harness.assert_idle()


def test_request_id_from_header_or_generated(
    gen: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    response, call = gen.Generate.with_call(
        request(max_tokens=2), metadata=(("x-request-id", "from-header"),)
    )
    assert response.request_id == "from-header"
    assert dict(call.initial_metadata())["x-request-id"] == "from-header"
    # The message's field wins over the header.
    response = gen.Generate(
        request(max_tokens=2, request_id="from-body"), metadata=(("x-request-id", "from-header"),)
    )
    assert response.request_id == "from-body"
    # Neither: the server makes one up and still echoes it.
    stream = gen.GenerateStream(request(max_tokens=2))
    first = next(stream)
    generated = dict(stream.initial_metadata())["x-request-id"]
    assert generated and first.start.request_id == generated
    list(stream)
    other = gen.Generate(request(max_tokens=2))
    assert other.request_id and other.request_id != generated


def test_n_choices_are_seeded_distinct_and_streamed(
    harness: ServerHarness, gen: generation_pb2_grpc.GenerationServiceStub
) -> None:
    req = request(max_tokens=10, n=3, temperature=1.0, seed=1234)
    first = gen.Generate(req)
    assert [c.index for c in first.choices] == [0, 1, 2]
    ids = [tuple(c.token_ids) for c in first.choices]
    assert all(len(t) == 10 for t in ids)
    assert len(set(ids)) == 3, "choices of one request must differ"
    assert [tuple(c.token_ids) for c in gen.Generate(req).choices] == ids  # reproducible
    assert first.usage.completion_tokens == 30

    events = list(gen.GenerateStream(req))
    ends = [e.end for e in events if e.HasField("end")]
    assert sorted(end.index for end in ends) == [0, 1, 2]  # exactly one end per choice
    assert events[-1].HasField("usage") and events[-1].usage.completion_tokens == 30
    for index in range(3):
        streamed = [
            t
            for e in events
            if e.HasField("delta") and e.delta.index == index
            for t in e.delta.token_ids
        ]
        assert tuple(streamed) == ids[index]
        end_at = next(i for i, e in enumerate(events) if e.HasField("end") and e.end.index == index)
        assert not any(e.HasField("delta") and e.delta.index == index for e in events[end_at:])
    harness.assert_idle()


def test_logprobs_report_chosen_and_top_alternatives(
    gen: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    req = request(max_tokens=6)
    req.output.logprobs = 4
    [choice] = gen.Generate(req).choices
    assert len(choice.logprobs) == len(choice.token_ids) == 6
    for token_id, position in zip(choice.token_ids, choice.logprobs, strict=True):
        assert position.chosen.token_id == token_id
        assert position.chosen.rank == 1  # greedy picks the most likely token
        assert position.chosen.logprob <= 0.0
        assert len(position.top) == 4
        assert [t.rank for t in position.top] == [1, 2, 3, 4]
        assert position.top[0].token_id == token_id
        assert position.top[0].logprob == pytest.approx(position.chosen.logprob)
        logprobs = [t.logprob for t in position.top]
        assert logprobs == sorted(logprobs, reverse=True)

    sampled = request(max_tokens=8, temperature=1.0, seed=7)
    sampled.output.logprobs = 2
    [choice] = gen.Generate(sampled).choices
    assert len(choice.logprobs) == 8
    for position in choice.logprobs:
        assert position.chosen.rank >= 1 and len(position.top) == 2
    # Streamed logprobs: one position per streamed token, same values as unary.
    events = list(gen.GenerateStream(req))
    streamed = [p for e in events if e.HasField("delta") for p in e.delta.logprobs]
    assert [p.chosen.token_id for p in streamed] == [
        p.chosen.token_id for p in gen.Generate(req).choices[0].logprobs
    ]
    # logprobs = 0: the chosen token only.
    req.output.logprobs = 0
    [choice] = gen.Generate(req).choices
    assert len(choice.logprobs) == 6 and all(not p.top for p in choice.logprobs)


@pytest.mark.parametrize("field", ["text", "chat"])
def test_text_and_chat_need_a_tokenizer(
    gen: generation_pb2_grpc.GenerationServiceStub, field: str
) -> None:
    req = generation_pb2.GenerateRequest()
    if field == "text":
        req.text = "hello"
    else:
        req.chat.messages.add(role="user", content="hello")
    with pytest.raises(grpc.RpcError) as err:
        gen.Generate(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(err.value)
    assert (info.reason, info.metadata["param"]) == ("INVALID_PARAMETER", field)


# ---------------------------------------------------------------------------- ModelService
def test_model_and_server_info(models: models_pb2_grpc.ModelServiceStub) -> None:
    info = models.GetModelInfo(models_pb2.GetModelInfoRequest())
    assert (info.name, info.vocab_size, list(info.eos_token_ids)) == (MODEL_NAME, 512, [2])
    assert info.max_context_tokens == 256 and not info.has_chat_template
    assert (info.max_n, info.max_logprobs) == (16, 20)
    assert (info.tensor_parallel_size, info.quantization, info.kv_cache_dtype) == (1, "", "auto")
    # The tiny llama's float32 parameters: embedding, 2 layers, norm, untied LM head.
    hidden, inter, vocab, kv = 64, 128, 512, 2 * 16  # kv: 2 KV heads x head_dim 16
    layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter + 2 * hidden
    assert info.weight_bytes == 4 * (2 * vocab * hidden + 2 * layer + hidden)
    assert info.kv_bytes_per_token == 2 * 2 * kv * 4  # 2 layers x (K + V) x float32
    assert list(models.ListModels(models_pb2.ListModelsRequest()).models) == [info]
    server = models.GetServerInfo(models_pb2.GetServerInfoRequest())
    assert (server.block_size, server.max_num_seqs, server.auth_required) == (16, 8, False)
    assert server.kv_blocks_total > 0 and server.prefix_caching


@pytest.mark.parametrize("method", ["Tokenize", "Detokenize"])
def test_tokenize_without_a_tokenizer_is_invalid(
    models: models_pb2_grpc.ModelServiceStub, method: str
) -> None:
    req: Any = (
        models_pb2.TokenizeRequest(text="hi")
        if method == "Tokenize"
        else models_pb2.DetokenizeRequest(token_ids=[5, 6])
    )
    with pytest.raises(grpc.RpcError) as err:
        getattr(models, method)(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(err.value).reason == "INVALID_PARAMETER"
    assert "tokenizer" in err.value.details()


# ---------------------------------------------------------------------------- health, reflection
def test_health_serving_after_start(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tokenwire.v1.GenerationService", "tokenwire.v1.ModelService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == SERVING


def test_fresh_server_is_not_serving_until_told(harness: ServerHarness) -> None:
    async def start() -> GrpcServer:
        server = GrpcServer(harness.engine, MODEL_NAME, GrpcSettings(port=0))
        await server.start()
        return server

    server = harness.run(start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            check = health_pb2.HealthCheckRequest(service="")
            assert health.Check(check).status == NOT_SERVING
            harness.run(server.set_serving(True))
            assert health.Check(check).status == SERVING
    finally:
        harness.run(server.stop(grace=0))


def test_reflection_lists_the_services(channel: grpc.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(
        stub.ServerReflectionInfo(
            iter(
                [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="tokenwire.v1.GenerationService"
                    ),
                ]
            )
        )
    )
    names = {s.name for s in replies[0].list_services_response.service}
    assert {
        "tokenwire.v1.GenerationService",
        "tokenwire.v1.ModelService",
        "grpc.health.v1.Health",
    } <= names
    assert replies[1].file_descriptor_response.file_descriptor_proto  # descriptors served


# ---------------------------------------------------------------------------- default model
@pytest.mark.slow
def test_tokenize_round_trip_on_the_default_model() -> None:
    harness = ServerHarness(None).start()
    try:
        with harness.channel() as ch:
            models = models_pb2_grpc.ModelServiceStub(ch)
            tokens = models.Tokenize(models_pb2.TokenizeRequest(text="Hello world"))
            assert tokens.token_ids and len(tokens.tokens) == len(tokens.token_ids)
            text = models.Detokenize(models_pb2.DetokenizeRequest(token_ids=tokens.token_ids))
            assert text.text == "Hello world"
            gen = generation_pb2_grpc.GenerationServiceStub(ch)
            by_text = gen.Generate(
                generation_pb2.GenerateRequest(
                    text="Hello world",
                    sampling=common_pb2.SamplingOptions(temperature=0.0),
                    stopping=common_pb2.StoppingOptions(max_tokens=5, ignore_eos=True),
                )
            )
            by_ids = gen.Generate(request(list(tokens.token_ids), max_tokens=5))
            assert by_text.usage.prompt_tokens == len(tokens.token_ids)
            assert by_text.choices[0].token_ids == by_ids.choices[0].token_ids
            assert by_text.choices[0].text == by_ids.choices[0].text != ""
        harness.assert_idle()
    finally:
        harness.stop()
