"""``tokenwire serve`` as a fleet worker (issue 28 items 2-4), one real server process with
its engine core in a process of its own:

- ``/metrics`` under vLLM's names (``--metrics-compat both``, the default): the gauges an
  endpoint picker reads, ``lora_requests_info``, ``cache_config_info`` and the prefix-cache
  counters, parsed with Prometheus' own parser; ``tokenwire:*`` still there;
- KV events from the core process over ZMQ (``--kv-events-config``), decoded with vLLM's
  schema: a repeated prompt's blocks are stored once, and the replay socket answers;
- ``--replica-id`` in ``GetServerInfo`` and ``/v1/models``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from serve_process import Served, serve
from vllm_kv_schema import KVEventBatch

from tokenwire.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    models_pb2,
    models_pb2_grpc,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


REPLAY = _free_port()
PUB = f"ipc://{tempfile.mkdtemp(prefix='tw-kv-')}/events"  # ipc:// is bound (vLLM's rule)
EVENTS = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": PUB,
    "replay_endpoint": f"tcp://127.0.0.1:{REPLAY}",
    "topic": "kv",
}


@pytest.fixture(scope="module")
def served(tiny_model_with_tokenizer: Path) -> Iterator[Served]:
    s = serve(
        tiny_model_with_tokenizer,
        *("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"),
        *("--replica-id", "replica-a", "--kv-events-config", json.dumps(EVENTS)),
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(PUB)
    s.sub = sub  # type: ignore[attr-defined]
    yield s
    s.proc.terminate()
    assert s.proc.wait(timeout=60) == 0
    ctx.destroy(linger=0)


def _generate(served: Served, ids: list[int]) -> None:
    with grpc.insecure_channel(served.target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=ids),
            stopping=common_pb2.StoppingOptions(max_tokens=2, ignore_eos=True),
        )
        stub.Generate(request, timeout=120)


def _samples(served: Served) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = httpx.get(f"{served.rest_url}/metrics", timeout=30).text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_vllm_named_metrics(served: Served) -> None:
    before = _samples(served)
    prompt = list(range(20, 60))  # 40 tokens: 2 full blocks of 16
    _generate(served, prompt)
    _generate(served, prompt)  # a prefix hit on both blocks
    after = _samples(served)
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ):
        ((labels, value),) = after[name]
        assert set(labels) == {"model_name"}
        assert value == 0.0  # idle again
        assert name.replace("vllm:", "tokenwire:") in after  # --metrics-compat both
    ((lora, _),) = after["vllm:lora_requests_info"]
    assert lora["max_lora"] == "2" and lora["running_lora_adapters"] == ""
    assert "waiting_lora_adapters" in lora
    ((cache, one),) = after["vllm:cache_config_info"]
    assert one == 1.0 and cache["block_size"] == "16" and int(cache["num_gpu_blocks"]) > 0
    assert cache["enable_prefix_caching"] == "True"

    def delta(name: str) -> float:
        return after[name][0][1] - (before[name][0][1] if name in before else 0.0)

    assert delta("vllm:prefix_cache_queries_total") == 80
    assert delta("vllm:prefix_cache_hits_total") == 32


def test_kv_events_cross_the_core_process(served: Served) -> None:
    _generate(served, list(range(100, 140)))  # new blocks: something to publish now
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    ctx = zmq.Context()
    replay = ctx.socket(zmq.DEALER)
    replay.connect(f"tcp://127.0.0.1:{REPLAY}")
    replay.send_multipart((b"", (1).to_bytes(8, "big")))
    batches = []
    while True:
        _, seq, payload = replay.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        batches.append(decoder.decode(payload))
    ctx.destroy(linger=0)
    stored = [h for b in batches for e in b.events if type(e).__name__ == "BlockStored"
              for h in e.block_hashes]  # fmt: skip
    assert len(stored) == len(set(stored)) >= 2  # the repeated prompt stored its blocks once
    sub = served.sub  # type: ignore[attr-defined]
    # PUB/SUB drops what is published before the subscription reaches the publisher: new
    # blocks are stored until one batch arrives (poll with a deadline, no sleep).
    for offset in range(200, 1000, 40):
        _generate(served, list(range(offset, offset + 40)))
        if sub.poll(1000):
            break
    topic, _seq, payload = sub.recv_multipart()
    assert topic == b"kv" and decoder.decode(payload).events


def test_replica_id(served: Served) -> None:
    with grpc.insecure_channel(served.target) as channel:
        info = models_pb2_grpc.ModelServiceStub(channel).GetServerInfo(
            models_pb2.GetServerInfoRequest(), timeout=30
        )
    assert info.replica_id == "replica-a"
    assert httpx.get(f"{served.rest_url}/v1/models", timeout=30).json()["replica_id"] == "replica-a"


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary here")
def test_real_prometheus_scrapes_the_vllm_names(served: Served, tmp_path: Path) -> None:
    """A real Prometheus server scrapes /metrics and answers PromQL on the vLLM names."""
    port = _free_port()
    target = served.rest_url.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs:\n- job_name: tw\n  static_configs:\n  - targets: ['{target}']\n"
    )
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'db'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wanted = (
            "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:lora_requests_info", "vllm:cache_config_info",
        )  # fmt: skip
        found: dict[str, list[dict[str, Any]]] = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(found) < len(wanted):
            for name in wanted:
                with contextlib.suppress(httpx.HTTPError):
                    reply = httpx.get(
                        f"http://127.0.0.1:{port}/api/v1/query", params={"query": name}, timeout=5
                    )
                    result = reply.json()["data"]["result"]
                    if result:
                        found[name] = result
            if len(found) < len(wanted):
                assert proc.poll() is None, "prometheus exited"
                time.sleep(0.5)  # polling the next scrape (1 s interval), with a deadline
        assert set(found) == set(wanted), found
        (cache,) = found["vllm:cache_config_info"]
        assert cache["metric"]["block_size"] == "16" and cache["value"][1] == "1"
        (lora,) = found["vllm:lora_requests_info"]
        assert lora["metric"]["max_lora"] == "2"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
