"""The vLLM engine worker protocol (``vllm.grpc.engine.VllmEngine``) on tokenwire's gRPC
server, through smg-grpc-proto's generated stubs: what a gateway calls at registration,
Generate (unary and streamed, constraints, stops, n), every bad field named, cancel and
Abort leaving the engine idle with every KV block free."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import zipfile
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_helpers import details_of, greedy_request
from server_harness import ServerHarness
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from tokenwire.v1 import generation_pb2_grpc

pb = vllm_engine_pb2
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(worker_protocol="vllm", max_model_len=256)


@pytest.fixture(scope="module")
def engine_stub(channel: grpc.Channel) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


def generate(
    ids: list[int] | None = None, stream: bool = False, request_id: str = "r", **sampling: Any
) -> pb.GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 6)
    sampling.setdefault("ignore_eos", True)
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=PROMPT if ids is None else ids),
        sampling_params=pb.SamplingParams(**sampling),
        stream=stream,
    )


def invalid_field(stub: Any, request: pb.GenerateRequest) -> str:
    """The field a refused Generate names (its status is INVALID_ARGUMENT)."""
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request))
    err = caught.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    info, _ = details_of(err)
    assert info is not None
    assert err.details().startswith(info.metadata["param"])
    return info.metadata["param"]


def test_registration_rpcs(engine_stub: Any, harness: ServerHarness) -> None:
    health = engine_stub.HealthCheck(pb.HealthCheckRequest())
    assert health.healthy, health.message
    info = engine_stub.GetModelInfo(pb.GetModelInfoRequest())
    engine = harness.engine.info
    assert info.served_model_name == "tiny" and info.is_generation
    assert info.max_context_length == engine.max_model_len == 256
    assert info.vocab_size == engine.vocab_size
    assert list(info.eos_token_ids) == list(engine.eos_token_ids)
    server = engine_stub.GetServerInfo(pb.GetServerInfoRequest())
    assert server.block_size == engine.block_size and server.max_num_seqs == engine.max_num_seqs
    assert not server.is_paused and server.data_parallel_size == 1
    loads = engine_stub.GetLoads(pb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and len(loads.loads) == 1
    assert loads.loads[0].num_running_reqs == 0
    assert loads.loads[0].max_total_num_tokens == engine.num_kv_blocks * engine.block_size


def test_tokenizer_bundle(engine_stub: Any, harness: ServerHarness, tmp_path: Path) -> None:
    chunks = list(engine_stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    assert all(not c.sha256 for c in chunks[:-1]) and chunks[-1].sha256
    data = b"".join(c.data for c in chunks)
    assert hashlib.sha256(data).hexdigest() == chunks[-1].sha256
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and "config.json" in names
    from transformers import AutoTokenizer

    folder = tmp_path / "bundle"
    zipfile.ZipFile(io.BytesIO(data)).extractall(folder)
    rebuilt = AutoTokenizer.from_pretrained(folder)
    original = harness.engine.tokenizer
    assert original is not None
    text = "Hello, fleet! 123"
    assert rebuilt.encode(text) == original.encode(text)
    assert rebuilt.chat_template == original.chat_template


def test_generate_matches_tokenwire_v1(engine_stub: Any, channel: grpc.Channel) -> None:
    direct = generation_pb2_grpc.GenerationServiceStub(channel).Generate(greedy_request(PROMPT, 6))
    expected = list(direct.choices[0].token_ids)
    (unary,) = list(engine_stub.Generate(generate(request_id="u")))
    assert unary.HasField("complete")
    assert list(unary.complete.output_ids) == expected
    assert unary.complete.finish_reason == "length"
    assert unary.complete.prompt_tokens == len(PROMPT)
    assert unary.complete.completion_tokens == 6
    streamed = list(engine_stub.Generate(generate(stream=True, request_id="s")))
    chunks = [m.chunk for m in streamed if m.HasField("chunk")]
    assert [t for c in chunks for t in c.token_ids] == expected
    assert sum(c.completion_tokens for c in chunks) == 6
    assert streamed[-1].HasField("complete") and streamed[-1].complete.finish_reason == "length"


def test_logprobs_n_and_seed(engine_stub: Any) -> None:
    request = generate(request_id="n2", temperature=1.0, n=2, seed=7, logprobs=2)
    messages = list(engine_stub.Generate(request))
    completes = [m.complete for m in messages]
    assert [c.index for c in completes] == [0, 1]
    for complete in completes:
        assert len(complete.output_ids) == 6
        assert list(complete.output_logprobs.token_ids) == list(complete.output_ids)
        assert all(len(top.token_ids) == 2 for top in complete.output_logprobs.top_logprobs)
    again = list(engine_stub.Generate(generate(request_id="n2b", temperature=1.0, n=2, seed=7)))
    assert [list(m.complete.output_ids) for m in again] == [list(c.output_ids) for c in completes]


def test_stop_token_and_prompt_logprobs(engine_stub: Any) -> None:
    (first,) = list(engine_stub.Generate(generate(request_id="p")))
    stop_id = first.complete.output_ids[2]
    (stopped,) = list(
        engine_stub.Generate(generate(request_id="st", stop_token_ids=[stop_id], prompt_logprobs=1))
    )
    complete = stopped.complete
    assert complete.finish_reason == "stop" and complete.matched_token_id == stop_id
    assert list(complete.output_ids) == list(first.complete.output_ids[:3])
    prompt = complete.input_logprobs
    assert list(prompt.token_ids) == PROMPT
    assert not prompt.token_logprobs[0].HasField("value")
    assert all(v.HasField("value") for v in prompt.token_logprobs[1:])


def test_constraints(engine_stub: Any, harness: ServerHarness) -> None:
    tokenizer = harness.engine.tokenizer
    assert tokenizer is not None
    schema = json.dumps({"type": "string", "enum": ["yes", "no"]})
    (answer,) = list(
        engine_stub.Generate(
            generate(request_id="js", json_schema=schema, max_tokens=20, ignore_eos=False)
        )
    )
    assert answer.complete.finish_reason == "stop"
    text = tokenizer.decode(list(answer.complete.output_ids), skip_special_tokens=True)
    assert json.loads(text) in ("yes", "no")
    choice = pb.ChoiceConstraint(choices=["alpha", "beta"])
    (picked,) = list(
        engine_stub.Generate(
            generate(request_id="ch", choice=choice, max_tokens=20, ignore_eos=False)
        )
    )
    text = tokenizer.decode(list(picked.complete.output_ids), skip_special_tokens=True)
    assert text in ("alpha", "beta")


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        (dict(temperature=-1.0), "sampling_params.temperature"),
        (dict(top_p=2.0), "sampling_params.top_p"),
        (dict(n=99), "sampling_params.n"),
        (dict(logprobs=-1), "sampling_params.logprobs"),
        (dict(max_tokens=10_000), "sampling_params.max_tokens"),
        (dict(json_schema="{not json"), "sampling_params.json_schema"),
        (dict(regex="(unclosed"), "sampling_params.regex"),
        (dict(truncate_prompt_tokens=0), "sampling_params.truncate_prompt_tokens"),
        (dict(ids=[]), "tokenized.input_ids"),
        (dict(ids=[10**7]), "tokenized.input_ids"),
    ],
)
def test_invalid_field_named(
    engine_stub: Any, harness: ServerHarness, request_fields: dict[str, Any], field: str
) -> None:
    ids = request_fields.pop("ids", None)
    assert invalid_field(engine_stub, generate(ids, request_id="bad", **request_fields)) == field
    harness.assert_idle()


def test_unsupported_inputs_named(engine_stub: Any) -> None:
    request = generate(request_id="mm")
    request.mm_inputs.im_token_id = 3
    assert invalid_field(engine_stub, request) == "mm_inputs"
    request = generate(request_id="kv")
    request.kv_transfer_params_json = "{}"
    assert invalid_field(engine_stub, request) == "kv_transfer_params_json"
    request = generate(request_id="dp")
    request.data_parallel_rank = 3
    assert invalid_field(engine_stub, request) == "data_parallel_rank"
    request = pb.GenerateRequest(request_id="none")
    assert invalid_field(engine_stub, request) == "tokenized"


def test_cancel_mid_stream_frees_blocks(engine_stub: Any, harness: ServerHarness) -> None:
    call = engine_stub.Generate(generate(stream=True, request_id="c", max_tokens=200))
    first = next(call)
    assert first.HasField("chunk")
    call.cancel()
    harness.assert_idle()


def test_abort_rpc_ends_stream(engine_stub: Any, harness: ServerHarness) -> None:
    call = engine_stub.Generate(generate(stream=True, request_id="ab", max_tokens=200))
    started = threading.Event()
    messages: list[Any] = []

    def read() -> None:
        for message in call:
            messages.append(message)
            started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(30)
    engine_stub.Abort(pb.AbortRequest(request_ids=["ab", "never-seen"]))
    reader.join(30)
    assert not reader.is_alive()
    assert messages[-1].HasField("complete") and messages[-1].complete.finish_reason == "abort"
    assert sum(len(m.chunk.token_ids) for m in messages) < 200
    harness.assert_idle()


def test_unimplemented_and_flush(engine_stub: Any) -> None:
    for call, request in (
        (engine_stub.StartProfile, common_pb2.StartProfileRequest()),
        (engine_stub.StopProfile, common_pb2.StopProfileRequest()),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            call(request)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "not implemented" in (caught.value.details() or "")
    with pytest.raises(grpc.RpcError) as caught:
        list(engine_stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest()))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "--kv-events-config" in (caught.value.details() or "")
    flushed = engine_stub.FlushCache(common_pb2.FlushCacheRequest())  # idle: the reset runs
    assert flushed.success, flushed.message


def test_undecodable_request_is_malformed(channel: grpc.Channel) -> None:
    """The malformed-request guard covers this service too: INVALID_ARGUMENT, never UNKNOWN."""
    raw = channel.unary_stream(
        "/vllm.grpc.engine.VllmEngine/Generate",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(raw(b"\x0a\xff\xff\xff\xff\xff"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info, _ = details_of(caught.value)
    assert info is not None and info.reason == "MALFORMED_REQUEST"
