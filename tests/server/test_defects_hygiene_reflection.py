"""gRPC server reflection answers under the v1 service name
``grpc.reflection.v1.ServerReflection`` (defects issue, item 19), as grpcurl and current grpc
clients ask first, as well as v1alpha. The client runs in a fresh process that imports
nothing of tokenwire: it lists the services over v1, fetches the file of
``tokenwire.v1.GenerationService`` and of the v1 reflection service itself, builds a
descriptor pool from what the server sent, and asks again with request messages made from the
served v1 schema (the protocol a reflection client speaks, end to end)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import ServerHarness

V1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
_CLIENT = r"""
import json, sys
import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2 as wire  # the same bytes as v1

def ask(channel, requests, request_type=wire.ServerReflectionRequest):
    call = channel.stream_stream(sys.argv[2], request_serializer=request_type.SerializeToString,
                                 response_deserializer=wire.ServerReflectionResponse.FromString)
    return list(call(iter(requests), timeout=30))

with grpc.insecure_channel(sys.argv[1]) as channel:
    listed, generation, own = ask(channel, [
        wire.ServerReflectionRequest(list_services=""),
        wire.ServerReflectionRequest(file_containing_symbol="tokenwire.v1.GenerationService"),
        wire.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
    ])
    pool = descriptor_pool.DescriptorPool()
    files = [*generation.file_descriptor_response.file_descriptor_proto,
             *own.file_descriptor_response.file_descriptor_proto]
    pending = {}
    for blob in files:
        f = descriptor_pb2.FileDescriptorProto.FromString(blob)
        pending[f.name] = f
    added = set()
    while pending:  # each file after the files it imports
        ready = [f for f in pending.values() if set(f.dependency) <= added]
        if not ready:
            raise SystemExit(f"the server did not send what {sorted(pending)} import")
        for f in ready:
            pool.Add(f)
            added.add(f.name)
            del pending[f.name]
    service = pool.FindServiceByName("grpc.reflection.v1.ServerReflection")
    (method,) = service.methods
    request_v1 = message_factory.GetMessageClass(method.input_type)
    (again,) = ask(channel, [request_v1(list_services="")], request_v1)
    print(json.dumps({
        "services": sorted(s.name for s in listed.list_services_response.service),
        "again": sorted(s.name for s in again.list_services_response.service),
        "generation_methods": [m.name for m in
                               pool.FindServiceByName("tokenwire.v1.GenerationService").methods],
        "v1_request": method.input_type.full_name,
    }))
"""


@pytest.fixture(scope="module")
def harness_model(tiny_model_with_tokenizer: Path) -> Path:
    return tiny_model_with_tokenizer


def _reflect(target: str, path: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _CLIENT, target, path],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_v1_reflection_client(harness: ServerHarness) -> None:
    got = _reflect(harness.target, V1)
    services = got["services"]
    assert isinstance(services, list)
    assert {
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.health.v1.Health",
        "tokenwire.v1.GenerationService",
        "tokenwire.v1.ModelService",
    } <= set(services)
    assert got["again"] == services  # a request made from the served v1 schema
    assert got["v1_request"] == "grpc.reflection.v1.ServerReflectionRequest"
    assert {"Generate", "GenerateStream", "Session", "Cancel"} <= set(
        got["generation_methods"]  # type: ignore[arg-type]
    )


def test_v1alpha_still_answers(harness: ServerHarness) -> None:
    got = _reflect(harness.target, V1.replace(".v1.", ".v1alpha."))
    assert "grpc.reflection.v1.ServerReflection" in got["services"]  # type: ignore[operator]
