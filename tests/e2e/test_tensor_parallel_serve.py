"""Tensor parallelism behind the server: ``--tensor-parallel-size 2`` answers through gRPC and
REST; two "nodes" on loopback (``tokenwire serve`` + ``tokenwire worker``, separate process
trees); a rank killed or hung mid-stream ends every stream UNAVAILABLE within 10 s, a rank
killed while the engine is idle ends it too, and no process is left behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import details_of, greedy_request
from parity import hf_greedy
from rest_harness import RestHarness
from serve_process import Served, serve, wait_gone
from server_harness import ServerHarness

from tokenwire.runtime.distributed.init import free_loopback_port
from tokenwire.v1 import generation_pb2_grpc, models_pb2, models_pb2_grpc

pytestmark = pytest.mark.slow
PROMPT = [5, 6, 7, 8, 9]
NEW_TOKENS = 32  # hf_greedy's


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_served_tp2_answers_grpc_and_rest(
    tiny_model_factory: Callable[..., Path], async_scheduling: bool
) -> None:
    path = tiny_model_factory("llama")
    expected = hf_greedy(path, [PROMPT])[0]
    harness = ServerHarness(path, tensor_parallel_size=2, async_scheduling=async_scheduling).start()
    rest = RestHarness(harness).start()
    try:
        with harness.channel() as ch:
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            reply = stub.Generate(greedy_request(PROMPT, NEW_TOKENS))
            assert list(reply.choices[0].token_ids) == expected
            streamed = [
                t for e in stub.GenerateStream(greedy_request(PROMPT, NEW_TOKENS))
                for t in e.delta.token_ids
            ]  # fmt: skip
            assert streamed == expected
            info = models_pb2_grpc.ModelServiceStub(ch).GetModelInfo(
                models_pb2.GetModelInfoRequest()
            )
            assert info.tensor_parallel_size == 2
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}  # fmt: skip
        answer = httpx.post(f"{rest.url}/v1/completions", json=body, timeout=60).json()
        tokens = answer["choices"][0]["logprobs"]["tokens"]
        assert [int(t.removeprefix("token_id:")) for t in tokens] == expected
        harness.assert_idle()
    finally:
        rest.stop()
        harness.stop()


def _worker(path: Path, *args: str) -> subprocess.Popen[str]:
    exe = shutil.which("tokenwire", path=os.path.dirname(sys.executable))
    assert exe is not None
    return subprocess.Popen(
        [exe, "worker", str(path), "--device", "cpu", "--max-model-len", "256", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
        start_new_session=True,
    )


@pytest.mark.parametrize("scheduling", ["--no-async-scheduling", "--async-scheduling"])
def test_two_nodes_on_loopback(tiny_model_factory: Callable[..., Path], scheduling: str) -> None:
    """Rank 0 broadcasts each step to node 1 (with async steps: one queued behind another)."""
    path = tiny_model_factory("llama")
    expected = hf_greedy(path, [PROMPT])[0]
    port = free_loopback_port()
    cluster = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port)]  # fmt: skip
    node1 = _worker(path, *cluster, "--node-rank", "1")
    node0: Served | None = None
    try:
        node0 = serve(path, *cluster, "--node-rank", "0", scheduling)
        with grpc.insecure_channel(node0.target) as ch:
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            reply = stub.Generate(greedy_request(PROMPT, NEW_TOKENS))
        assert list(reply.choices[0].token_ids) == expected
        groups = [*node0.group(), node1.pid]
        node0.proc.terminate()  # a clean stop: node 1's ranks get Stop and end too
        assert node0.proc.wait(timeout=60) == 0
        assert node1.wait(timeout=60) == 0
        assert wait_gone(groups, 10.0) == []
    finally:
        for proc in (node1, node0.proc if node0 else None):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def _ranks(served: Served) -> list[psutil.Process]:
    core = psutil.Process(served.core_pid)
    ranks = [p for p in core.children() if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(ranks) == 2, ranks
    return ranks


@pytest.mark.parametrize("scheduling", ["--no-async-scheduling", "--async-scheduling"])
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_rank_fault_mid_stream_ends_every_stream(
    tiny_model_with_tokenizer: Path, fault: str, scheduling: str
) -> None:
    """Also with async scheduling: a step is queued at the ranks behind the one that fails."""
    served = serve(
        tiny_model_with_tokenizer,
        "--tensor-parallel-size", "2", "--distributed-timeout", "3", scheduling,
    )  # fmt: skip
    try:
        rank1 = _ranks(served)[1]
        with grpc.insecure_channel(served.target) as ch:
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            streams = [stub.GenerateStream(greedy_request(PROMPT, 200, request_id=f"s{i}"))
                       for i in range(3)]  # fmt: skip
            for call in streams:
                assert next(call).HasField("start")
            rank1.suspend()  # hung: every stream is in flight; "killed" then kills it
            if fault == "killed":
                rank1.kill()
            hit_at = time.monotonic()
            for call in streams:
                with pytest.raises(grpc.RpcError) as caught:
                    for _ in call:
                        pass
                info, _ = details_of(caught.value)
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                assert info is not None and info.reason == "ENGINE_DEAD"
            assert time.monotonic() - hit_at < 10.0
        assert served.proc.wait(timeout=60) != 0
        assert wait_gone(served.group(), 10.0) == []
    finally:
        if served.proc.poll() is None:
            os.killpg(served.proc.pid, signal.SIGKILL)


def test_rank_killed_while_idle_ends_the_engine(tiny_model_with_tokenizer: Path) -> None:
    """No request in flight: the idle core checks its workers every second."""
    served = serve(tiny_model_with_tokenizer, "--tensor-parallel-size", "2")
    try:
        with grpc.insecure_channel(served.target) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            rank1 = _ranks(served)[1]
            rank1.kill()
            killed_at = time.monotonic()
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert time.monotonic() - killed_at < 10.0
        assert served.proc.wait(timeout=60) != 0
        assert wait_gone(served.group(), 10.0) == []
    finally:
        if served.proc.poll() is None:
            os.killpg(served.proc.pid, signal.SIGKILL)
