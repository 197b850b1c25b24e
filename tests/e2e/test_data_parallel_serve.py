"""Data parallelism behind one front (``--data-parallel-size 2``: two engine-core processes):
greedy tokens equal HF on every core through gRPC and REST, 32 concurrent requests spread
over both cores, a Session stays on its core turn after turn, both cores end idle with every
block free, and a killed core ends the server with no process left behind (the documented
choice, as with one core)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from grpc_helpers import greedy_request
from parity import hf_greedy
from rest_harness import RestHarness
from serve_process import serve, wait_gone
from server_harness import ServerHarness

from tokenwire.clients import results as r
from tokenwire.clients.client import Client
from tokenwire.runtime.engine.dp_client import DPCoreClient
from tokenwire.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow
NEW_TOKENS = 32  # hf_greedy's
PROMPTS = [[5 + i, 6, 7 + 2 * i, 8, 9, 10 + i] for i in range(8)]


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def harness(model: Path) -> Iterator[ServerHarness]:
    server = ServerHarness(model, data_parallel_size=2, max_num_seqs=16).start()
    yield server
    server.stop()


def _balancer(harness: ServerHarness) -> DPCoreClient:
    client = harness.engine.client
    assert isinstance(client, DPCoreClient)
    return client


def test_two_cores_answer_grpc_and_rest_with_hf_tokens(harness: ServerHarness, model: Path) -> None:
    expected = hf_greedy(model, PROMPTS)
    dp = _balancer(harness)
    assert len({p for p in dp.pids}) == 2 and os.getpid() not in dp.pids
    before = list(dp.balancer.assigned)

    def ask(i: int) -> list[int]:
        with harness.channel() as ch:
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            reply = stub.Generate(greedy_request(PROMPTS[i % 8], NEW_TOKENS))
            return list(reply.choices[0].token_ids)

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, range(32)))
    assert answers == [expected[i % 8] for i in range(32)]
    spread = [after - b for after, b in zip(dp.balancer.assigned, before, strict=True)]
    assert sum(spread) == 32 and min(spread) >= 8, spread  # both cores served a share
    rest = RestHarness(harness).start()
    try:
        body = {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": NEW_TOKENS,
                "temperature": 0, "ignore_eos": True, "logprobs": 0}  # fmt: skip
        answer = httpx.post(f"{rest.url}/v1/completions", json=body, timeout=60).json()
        tokens = answer["choices"][0]["logprobs"]["tokens"]
        assert [int(t.removeprefix("token_id:")) for t in tokens] == expected[3]
    finally:
        rest.stop()
    harness.assert_idle()  # both cores: no request, every block free, invariants intact
    assert dp.balancer.tracked() == 0


def test_a_session_stays_on_its_core_under_load(harness: ServerHarness) -> None:
    dp = _balancer(harness)
    stop = threading.Event()

    def background() -> None:  # keeps both cores busy with unrelated prompts
        with harness.channel() as ch:
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            i = 0
            while not stop.is_set():
                stub.Generate(greedy_request([300 + i % 50, 7, 8, 9], 8))
                i += 1

    workers = [threading.Thread(target=background) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        with (
            Client(harness.target, timeout=60) as client,
            client.session(temperature=0.0, max_tokens=6) as session,
        ):
            list(session.send(token_ids=list(range(20, 52))))
            for turn in range(3):
                events = list(session.send(token_ids=[60 + turn, 61, 62]))
                started = next(e for e in events if isinstance(e, r.TurnStart))
                assert started.cached_tokens >= 32, (turn, started)  # its own core's blocks
    finally:
        stop.set()
        for w in workers:
            w.join()
    harness.assert_idle()
    assert dp.balancer.tracked() == 0


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_core_ends_the_server(model: Path, victim: int) -> None:
    """Either core dying ends the server non-zero, and no process of it is left: not the
    other core, not a resource tracker (all taken before the kill, not only the group's)."""
    served = serve(model, "--data-parallel-size", "2", "--served-model-name", "tiny")
    try:
        front = psutil.Process(served.proc.pid)
        cores = [p for p in front.children() if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(cores) == 2, cores
        everything = [p.pid for p in served.tree()]
        assert len(everything) >= 3, everything
        with grpc.insecure_channel(served.target) as ch:
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            assert len(stub.Generate(greedy_request(PROMPTS[0], 4)).choices[0].token_ids) == 4
        cores[victim].kill()
        assert served.proc.wait(timeout=60) != 0
        assert wait_gone(everything, 10.0) == []
        assert wait_gone(served.group(), 10.0) == []
    finally:
        if served.proc.poll() is None:
            os.killpg(served.proc.pid, signal.SIGKILL)
