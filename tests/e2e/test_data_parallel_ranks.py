"""Each rank of a ``--data-parallel-size 2`` server (two engine-core processes) seen from outside:
the vLLM worker protocol's ``GetLoads`` answers one ``SchedulerLoad`` per rank and routes a
Generate that names ``data_parallel_rank`` to that core (an absent rank is INVALID_ARGUMENT
naming the field), request and step spans carry ``tokenwire.dp_rank``, ``/metrics`` has one
series per core with vLLM's ``engine`` label, and the KV totals sum over both cores at idle."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_helpers import details_of
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL_NAME, ServerHarness
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from tokenwire.runtime.engine.dp_client import DPCoreClient
from tokenwire.runtime.engine.dp_merge import idle_snapshot
from tokenwire.server.grpc.server import GrpcServer, GrpcSettings
from tokenwire.server.telemetry.core import Telemetry

pytestmark = pytest.mark.slow
pb = vllm_engine_pb2


@dataclass
class Served:
    harness: ServerHarness
    stub: Any  # VllmEngineStub on a server whose telemetry is the engine's observer
    telemetry: Telemetry
    exporter: InMemorySpanExporter

    @property
    def dp(self) -> DPCoreClient:
        client = self.harness.engine.client
        assert isinstance(client, DPCoreClient)
        return client


@pytest.fixture(scope="module")
def served(tiny_model_factory: Callable[..., Path]) -> Iterator[Served]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry(provider=provider)
    harness = ServerHarness(
        tiny_model_factory("llama"), data_parallel_size=2, observer=telemetry
    ).start()

    async def side() -> tuple[GrpcServer, int]:
        settings = GrpcSettings(port=0, worker_protocol="vllm")
        server = GrpcServer(harness.engine, MODEL_NAME, settings, telemetry)
        port = await server.start()
        await server.set_serving(True)
        return server, port

    server, port = harness.run(side())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Served(harness, vllm_engine_pb2_grpc.VllmEngineStub(channel), telemetry, exporter)
    finally:
        channel.close()
        harness.run(server.stop(grace=0.5))
        harness.stop()


def generate(rank: int | None, request_id: str, max_tokens: int = 4) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=[5, 6, 7, 8, 9]),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        stream=True,
    )
    if rank is not None:
        request.data_parallel_rank = rank
    return request


def wait_spans(exporter: InMemorySpanExporter, ready: Callable[[list[ReadableSpan]], bool]) -> None:
    deadline = time.monotonic() + 30
    while not ready(list(exporter.get_finished_spans())):
        assert time.monotonic() < deadline, "spans never arrived"
        time.sleep(0.05)


def test_get_loads_answers_one_load_per_rank(served: Served) -> None:
    info = served.harness.engine.info
    assert len(info.rank_kv_blocks) == 2
    server = served.stub.GetServerInfo(pb.GetServerInfoRequest())
    assert server.data_parallel_size == 2
    loads = served.stub.GetLoads(pb.GetLoadsRequest())
    assert loads.dp_rank_count == 2
    assert [load.dp_rank for load in loads.loads] == [0, 1]
    for load, blocks in zip(loads.loads, info.rank_kv_blocks, strict=True):
        assert load.max_total_num_tokens == blocks * info.block_size
    one = served.stub.GetLoads(pb.GetLoadsRequest(dp_rank=1))
    assert one.dp_rank_count == 2 and [load.dp_rank for load in one.loads] == [1]
    # A long request pinned to rank 1 shows as running there, and only there.
    stream = served.stub.Generate(generate(1, "busy", max_tokens=200))
    next(stream)  # its first tokens are out: the core runs it
    deadline = time.monotonic() + 10
    while [load.num_running_reqs for load in served.stub.GetLoads(pb.GetLoadsRequest()).loads] != [
        0,
        1,
    ]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    stream.cancel()
    served.harness.assert_idle()


def test_a_named_rank_serves_the_request_and_spans_carry_it(served: Served) -> None:
    dp = served.dp
    for rank in (1, 0, 1):
        before = list(dp.balancer.assigned)
        served.exporter.clear()
        chunks = list(served.stub.Generate(generate(rank, f"pinned-{rank}")))
        assert chunks[-1].HasField("complete")
        after = dp.balancer.assigned
        assert [a - b for a, b in zip(after, before, strict=True)] == [
            int(rank == 0),
            int(rank == 1),
        ]

        def done(spans: list[ReadableSpan]) -> bool:
            return any(s.name == "tokenwire.request" for s in spans)

        wait_spans(served.exporter, done)
        spans = served.exporter.get_finished_spans()
        request = next(s for s in spans if s.name == "tokenwire.request")
        assert request.attributes is not None and request.attributes["tokenwire.dp_rank"] == rank
        children = [s for s in spans if s.name in ("tokenwire.queue", "tokenwire.decode")]
        assert children and all(
            s.attributes and s.attributes["tokenwire.dp_rank"] == rank for s in children
        )
        steps = [s for s in spans if s.name == "tokenwire.step"]
        assert steps and {s.attributes["tokenwire.dp_rank"] for s in steps if s.attributes} == {
            rank
        }
    with pytest.raises(grpc.RpcError) as caught:
        list(served.stub.Generate(generate(2, "no-such-rank")))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    error, _ = details_of(caught.value)
    assert error is not None and error.metadata["param"] == "data_parallel_rank"
    assert "got 2" in (caught.value.details() or "")
    served.harness.assert_idle()


def _samples(exposition: bytes, name: str) -> dict[str, float]:
    """``engine`` label -> value of the family ``name`` (every sample must carry one)."""
    for family in text_string_to_metric_families(exposition.decode()):
        if family.name == name:
            return {s.labels["engine"]: s.value for s in family.samples}
    raise AssertionError(f"{name} missing")


def test_metrics_have_a_series_per_engine_and_kv_sums_at_idle(served: Served) -> None:
    served.harness.assert_idle()
    info = served.harness.engine.info
    exposition = served.telemetry.exposition()
    for prefix in ("vllm", "tokenwire"):
        assert _samples(exposition, f"{prefix}:num_requests_running") == {"0": 0.0, "1": 0.0}
        blocks = _samples(exposition, f"{prefix}:kv_cache_num_blocks")
        assert blocks == {str(r): float(n) for r, n in enumerate(info.rank_kv_blocks)}
        assert _samples(exposition, f"{prefix}:kv_cache_free_blocks") == blocks
    # The merged snapshot at idle: block totals and free blocks summed over both cores.
    snapshot = served.harness.engine.stats_snapshot()
    assert snapshot.kv_blocks_total == snapshot.kv_blocks_free == sum(info.rank_kv_blocks)
    assert [r.kv_blocks_total for r in snapshot.ranks] == list(info.rank_kv_blocks)
    # What the front reads before any core has stepped: every core's blocks, not rank 0's.
    start = idle_snapshot(info)
    assert start.kv_blocks_total == start.kv_blocks_free == sum(info.rank_kv_blocks)
    assert len(start.ranks) == 2
