"""The vLLM engine protocol behind tokenwire's own gates: API keys (bearer metadata), the open
standard health service, reflection, and drain (HealthCheck unhealthy, Generate
UNAVAILABLE) — the same as tokenwire.v1 on the same port."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import details_of
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_harness import ServerHarness
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

pb = vllm_engine_pb2
KEY = (("authorization", "Bearer k-fleet"),)
SERVICE = "vllm.grpc.engine.VllmEngine"


@pytest.fixture(scope="module")
def harness_options() -> dict[str, Any]:
    return dict(worker_protocol="vllm", api_keys=("k-fleet",))


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


def request(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    )


def test_every_rpc_needs_the_key(stub: Any) -> None:
    for call in (
        lambda md: stub.HealthCheck(pb.HealthCheckRequest(), metadata=md),
        lambda md: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md),
        lambda md: list(stub.Generate(request("k"), metadata=md)),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            call((("authorization", "Bearer wrong"),))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info, _ = details_of(caught.value)
        assert info is not None and info.reason == "API_KEY_INVALID"
        assert call(KEY)  # with the key: an answer
    (done,) = list(stub.Generate(request("k2"), metadata=KEY))
    assert done.complete.finish_reason == "length"


def test_health_and_reflection_list_the_service(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)  # open, as for tokenwire.v1
    reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=KEY
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert SERVICE in names


def test_drain_turns_the_worker_away(stub: Any, harness: ServerHarness) -> None:
    """Runs last: a drained server stays drained."""
    harness.run(harness.server.drain(5.0))
    health = stub.HealthCheck(pb.HealthCheckRequest(), metadata=KEY)
    assert not health.healthy and "draining" in health.message
    assert stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=KEY).is_paused
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request("late"), metadata=KEY))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    info, _ = details_of(caught.value)
    assert info is not None and info.reason == "SERVER_DRAINING"
    harness.assert_idle()
