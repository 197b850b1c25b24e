"""What SMG must send to pass tokenwire's API keys (docs/fleet.md#authentication), with the
real gateway: HTTP workers get the gateway's ``--api-key`` as a bearer token; over gRPC the
vLLM protocol needs ``authorization: Bearer`` metadata, which SMG 1.13 does not send, so a
keyed replica refuses it (checked here on the replica itself)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from serve_process import Served, serve
from smg_gateway import MODEL, Gateway, start_gateway
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

pytestmark = pytest.mark.timeout(300)
KEY = "fleet-key"


@pytest.fixture(scope="module")
def keyed_replica(tiny_model_with_tokenizer: Path) -> Iterator[Served]:
    served = serve(
        tiny_model_with_tokenizer,
        *("--served-model-name", MODEL, "--worker-protocol", "vllm", "--api-key", KEY),
    )
    yield served
    served.kill()


@pytest.fixture(scope="module")
def keyed_gateway(keyed_replica: Served) -> Iterator[Gateway]:
    gateway = start_gateway(
        [keyed_replica.rest_url], "--api-key", KEY, headers={"authorization": f"Bearer {KEY}"}
    )
    yield gateway
    gateway.stop()


def test_http_workers_get_the_gateway_key(keyed_gateway: Gateway) -> None:
    with openai.OpenAI(base_url=f"{keyed_gateway.url}/v1", api_key=KEY, max_retries=0) as c:
        reply = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
        )
        assert reply.choices[0].finish_reason == "length"
    wrong = openai.OpenAI(base_url=f"{keyed_gateway.url}/v1", api_key="wrong", max_retries=0)
    with wrong, pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )


def test_grpc_worker_protocol_needs_bearer_metadata(keyed_replica: Served) -> None:
    with grpc.insecure_channel(keyed_replica.target) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest())  # what SMG 1.13 sends
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.HealthCheck(
            vllm_engine_pb2.HealthCheckRequest(), metadata=(("authorization", f"Bearer {KEY}"),)
        )
        assert reply.healthy
